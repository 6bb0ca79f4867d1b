"""An exception in the user's code, raised in a worker, reaches the caller as itself (issue 26): its own
type (not Ray's `RayTaskError(ValueError)`), the worker's traceback attached once as `__cause__`, and no
terminal colour codes in its text or in anything written to a file or a pipe."""

from __future__ import annotations

import textwrap
import traceback
from pathlib import Path

import pytest

import distrain
from tests.unit.test_remote_errors import ESC

TASK = textwrap.dedent(
    """
    import torch
    from torch.utils.data import TensorDataset

    import distrain


    class RaisesAtStep3(distrain.Task):
        def __init__(self):
            self.steps = 0

        def build_model(self):
            return torch.nn.Linear(4, 1)

        def datasets(self):
            x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
            y = x.sum(1)
            return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])

        def loss(self, model, batch):
            if model.training:
                self.steps += 1
                if self.steps == 3:  # in the worker (the driver's check calls it once)
                    raise ValueError("my loss broke at step 3")
            return ((model(batch[0]).squeeze(-1) - batch[1]) ** 2).mean()
    """
)


def test_fit_raises_the_users_own_exception_without_colour_codes(ray_cluster, tmp_path):
    """Was `RayTaskError(ValueError)` with escape codes in its message (issue 26)."""
    path = tmp_path / "my_task.py"
    path.write_text(TASK)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="^my loss broke at step 3$") as info:
        distrain.fit(
            task=f"{path}:RaisesAtStep3", workers=1, batch_size=8, epochs=1, run_dir=str(run_dir), progress=False
        )
    exc = info.value
    assert type(exc) is ValueError and ESC not in str(exc)
    shown = "".join(traceback.format_exception(exc))
    assert ESC not in shown
    assert shown.count(f'File "{path}", line') == 1  # the user's frame, once
    assert shown.count("raise ValueError(\"my loss broke at step 3\")") == 1
    summary = (run_dir / "summary.json").read_text()
    assert '"status": "failed"' in summary
    for written in Path(run_dir).rglob("*"):
        if written.is_file():
            assert ESC.encode() not in written.read_bytes(), written
