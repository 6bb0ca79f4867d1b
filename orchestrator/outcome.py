"""How a run that got to its end is judged, and what its end says.

    judge(table, updates) -> the `diverged` record, or None: the run completed
    warnings(evals) -> lines for summary.json's `warnings` (the status stays)
    no_space_line(...) -> the one line of a run the disk filled up under

A run that trained to its last step is `diverged`, not `completed`, when its result is garbage:
- more than `SKIPPED_SHARE_LIMIT` of its global steps skipped an update as non-finite
  (`--on-nonfinite skip`; fp16's loss-scale overflows are normal and never count, see `skipped_steps`),
- or its final evaluation has a loss or metric that is not finite (NaN or inf).
Pure functions over the metrics table (no Ray, no torch), so every rule is tested on plain rows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from distrain.config import SKIPPED_SHARE_LIMIT

# SKIPPED_SHARE_LIMIT (config.py, where --on-nonfinite's help states it too): more than this share of a
# run's global steps skipped as non-finite ends it `diverged`. An update or two lost to a bad batch is
# what `skip` is for; one step in ten is a run that has diverged and goes on on whatever steps stay finite.
__all__ = [
    "SKIPPED_SHARE_LIMIT",
    "diverged_line",
    "final_evaluation",
    "judge",
    "no_space_line",
    "skipped_steps",
    "warnings",
]


def skipped_steps(table: pa.Table) -> int:
    """Global steps in which some update was skipped because a loss, gradient or average was not finite
    (the `nonfinite` rows), leaving out fp16's loss-scale overflows (`overflow` rows: the scale is
    halved and the step skipped, as torch.amp.GradScaler does; normal, not divergence)."""
    if table.num_rows == 0 or "nonfinite" not in table.column_names:
        return 0
    mask = pc.and_(pc.equal(table["kind"], "step"), pc.fill_null(table["nonfinite"], False))
    if "overflow" in table.column_names:
        mask = pc.and_(mask, pc.invert(pc.fill_null(table["overflow"], False)))
    return len(set(table.filter(mask)["step"].to_pylist()))


def final_evaluation(table: pa.Table) -> dict[str, float]:
    """The last evaluation's figures by column (`val_loss`, `test_loss`, `test_accuracy`, ...): those it reported,
    NaN and inf included (null means the task does not report that figure)."""
    if table.num_rows == 0:
        return {}
    evals = table.filter(pc.equal(table["kind"], "eval"))
    if evals.num_rows == 0:
        return {}
    times = evals["wall_time"].to_pylist()
    last = evals.slice(max(range(len(times)), key=lambda i: times[i] or 0.0), 1).to_pylist()[0]  # as summarize's
    return {k: float(v) for k, v in last.items() if k.startswith(("val_", "test_")) and v is not None}


def judge(table: pa.Table, updates: int) -> dict[str, Any] | None:
    """The `diverged` record of a run that trained `updates` global steps, or None if it completed."""
    skipped = skipped_steps(table)
    if updates and skipped / updates > SKIPPED_SHARE_LIMIT:
        return {"reason": "skipped_share", "skipped": skipped, "updates": updates, "limit": SKIPPED_SHARE_LIMIT}
    bad = sorted(name for name, value in final_evaluation(table).items() if not math.isfinite(value))
    if bad:
        return {"reason": "final_eval_nonfinite", "metrics": bad}
    return None


def diverged_line(record: dict[str, Any]) -> str:
    """The CLI's one line for a diverged run: what happened, and what to do."""
    reason = record.get("reason", "nonfinite")
    if reason == "skipped_share":
        skipped, updates = record["skipped"], record["updates"]
        return (
            f"training diverged: {skipped} of {updates} updates ({skipped / updates:.0%}) were skipped as non-finite "
            f"under --on-nonfinite skip (more than {record['limit']:.0%} ends a run as diverged); no final "
            "checkpoint was written; lower --lr, or run with --on-nonfinite stop to see the step where it starts"
        )
    if reason == "final_eval_nonfinite":
        names = ", ".join(record["metrics"])
        return (
            f"training diverged: the final evaluation's {names} is not finite (NaN or inf); no final checkpoint "
            "was written; lower --lr, or check the task's loss and metrics"
        )
    where = f"worker {record['worker']}'s {record['what']}" if record.get("worker") is not None else record["what"]
    return (
        f"training diverged at step {record['step']} ({where} not finite); no checkpoint was written after it; "
        "lower --lr, or pass --on-nonfinite skip to skip such updates"
    )


def warnings(evals: pd.DataFrame) -> list[str]:
    """What a run that ended well enough to keep its status should still tell: a final test loss above
    its first evaluation's (training made the model worse). The validation loss, every evaluation has it
    (runs recorded before the validation split: the test loss)."""
    lines = []
    column = "val_loss" if "val_loss" in evals and evals["val_loss"].notna().any() else "test_loss"
    loss = evals[column].dropna() if column in evals else evals.iloc[:0]
    if len(loss) >= 2:
        first, last = float(loss.iloc[0]), float(loss.iloc[-1])
        if math.isfinite(first) and math.isfinite(last) and last > first:
            split = "validation" if column == "val_loss" else "test"
            lines.append(
                f"the final {split} loss ({last:.4g}) is above the first evaluation's ({first:.4g}): training made "
                "the model worse; lower --lr (under async/ssp, keep the staleness-aware rate on: no --no-staleness-lr)"
            )
    return lines


def no_space_line(
    file: str, checkpoint: Path | None, step: int, run_dir: Path, summary_written: bool, summary_existed: bool
) -> str:
    """The one line of a run the disk filled up under: the file, that nothing before was lost, the last
    good checkpoint and how to go on from it, and whether summary.json could say `failed`."""
    line = f"no space left on device writing {file}; the run stops"
    if summary_written:
        line += " (summary.json: failed)"
    else:
        still = " (it still says unfinished)" if summary_existed else ""
        line += f"; there was no room to mark it failed in summary.json either{still}"
    if checkpoint is None:
        return line + "; no checkpoint was taken before it, so there is nothing to resume: free space and start again"
    return (
        f"{line}; nothing written before was lost: the last good checkpoint is {checkpoint} (step {step}); "
        f"free space, then continue with `distrain run --resume {run_dir}`"
    )
