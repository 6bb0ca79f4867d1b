"""The families of per-step columns the built-in strategies fill through `CommStats`, each declared by the
module that owns it (base.py `StepColumns`). metrics.parquet's schema, summary.json's figures and the report's
table column and plots are made from this list, so none of those modules names a strategy's column. No torch.
"""

from __future__ import annotations

from distrain.strategies.adacomm import LOCAL_SGD_STEP_COLUMNS
from distrain.strategies.consistency import PS_STEP_COLUMNS
from distrain.strategies.declarations import StepColumns

# BSP over the parameter server with backup workers or backup tasks (strategies/bsp.py): figures of their
# own come from the portion scheduler and the shards (`actor_figures`), not from these columns.
BACKUP_STEP_COLUMNS = StepColumns(
    {
        "dropped": "bool",  # the gradient came late (k-of-n) or was a second copy: not applied
        "backup": "bool",  # backup tasks: a speculative copy of a portion another worker had
    }
)

# In metrics.parquet's column order (the order of earlier versions' files).
STEP_COLUMN_FAMILIES: tuple[StepColumns, ...] = (PS_STEP_COLUMNS, BACKUP_STEP_COLUMNS, LOCAL_SGD_STEP_COLUMNS)


def family_columns() -> dict[str, str]:
    """Every family's columns, name -> Arrow type, in order."""
    return {name: kind for family in STEP_COLUMN_FAMILIES for name, kind in family.columns.items()}


def family_fields() -> dict[str, str]:
    """Every family's columns, name -> the `CommStats` field a step row takes it from, in order."""
    return {name: family.fields.get(name, name) for family in STEP_COLUMN_FAMILIES for name in family.columns}
