"""How a run ends, and what it says then (issue 26, "nothing lost, nothing silent, II").

- A garbage result is `diverged`, not `completed`: more than `SKIPPED_SHARE_LIMIT` of the steps skipped
  as non-finite under --on-nonfinite skip (fp16 overflows never count), or a final evaluation that is not
  finite (orchestrator/outcome.py); a test loss that ends above its first evaluation is a warning.
- A run that fails after it started (restarts used up, disk full) exits 4 with one line that names the
  run directory only where there is a checkpoint to resume; `--resume` of a directory without one says so.
- A full disk under a checkpoint is one line: the file, "no space left on device", the last good
  checkpoint; summary.json `failed`; nothing written before is lost and no temporary file is left.
- The closing summary: "not reached", bytes in units, and no summary.json keys that do not apply.

The rules are tested on plain tables and objects; a few tiny real runs (through the CLI, in-process, on
the session's Ray) check that the driver applies them.
"""

from __future__ import annotations

import errno
import json
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from distrain.cli import app
from distrain.orchestrator.checkpoint import latest_checkpoint, load_checkpoint
from tests.unit.test_run_outcome import REGRESSION

runner = CliRunner()
































# ---------------------------------------------------------------- tiny real runs through the CLI


def error_lines(result) -> list[str]:
    assert "Traceback" not in result.output, result.output
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.usefixtures("ray_cluster")
def test_a_run_that_skips_most_updates_ends_diverged_exit_3_and_has_nothing_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = ["run", "--model", "mlp", "--epochs", "1", "--max-steps", "8", "--lr", "1e30", "--on-nonfinite", "skip",
            "--workers", "1", "--run-dir", str(run_dir)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 3, result.output
    (line,) = error_lines(result)
    summary = json.loads((run_dir / "summary.json").read_text())
    d = summary["diverged"]
    assert summary["status"] == "diverged" and d["reason"] == "skipped_share" and d["updates"] == 8
    assert d["skipped"] == summary["nonfinite_steps"] > 0.1 * 8
    assert f"{d['skipped']} of 8 updates" in line and "--on-nonfinite skip" in line
    assert "diverged" in result.stdout  # the status row
    assert not (run_dir / "checkpoints" / "final.pt").exists()
    again = runner.invoke(app, ["run", "--resume", str(run_dir)])  # was "is not a distrain run"
    assert again.exit_code == 2 and error_lines(again) == [
        f"error: {run_dir} has no checkpoint to resume from; start the run again (with --checkpoint-steps N or "
        "--checkpoint-every N a run that stops can be resumed)"
    ]


@pytest.mark.usefixtures("ray_cluster")
def test_user_code_that_exits_past_max_failures_is_exit_4_and_says_there_is_no_checkpoint(tmp_path):
    path = tmp_path / "my_task.py"
    path.write_text(textwrap.dedent(REGRESSION))
    run_dir = tmp_path / "run"
    args = ["run", "--task", f"{path}:ExitsAtStep3", "--epochs", "3", "--workers", "1", "--max-failures", "1"]
    args += ["--run-dir", str(run_dir)]
    result = runner.invoke(app, args)
    assert result.exit_code == 4, result.output  # not 2: this is no bad input
    assert "restarting from the start" in result.stdout and "checkpoint at step 0" not in result.stdout
    (line,) = error_lines(result)
    assert "--max-failures 1 reached" in line and "no checkpoint was taken, so there is nothing to resume" in line
    assert "--resume" not in line and "<run dir>" not in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["failures"] == 2
    again = runner.invoke(app, ["run", "--resume", str(run_dir)])
    assert again.exit_code == 2 and len(error_lines(again)) == 1
    assert f"{run_dir} has no checkpoint to resume from" in again.stderr




@pytest.mark.usefixtures("ray_cluster")
def test_a_full_disk_under_a_checkpoint_is_one_line_exit_4_and_loses_nothing(tmp_path, monkeypatch):
    """The third checkpoint's write finds no space (part of it written first); the two before stay whole
    and the latest; summary.json says failed."""
    real_save, saves = torch.save, []

    def save(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) < 3:
            return real_save(obj, f, *args, **kwargs)
        with open(f, "ab") if isinstance(f, str | bytes) or hasattr(f, "__fspath__") else f as out:
            out.write(b"part of a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", save)  # the driver's checkpoint writes (the workers are other processes)
    run_dir = tmp_path / "run"
    args = ["run", "--model", "mlp", "--epochs", "1", "--max-steps", "8", "--checkpoint-steps", "2", "--workers", "1",
            "--run-dir", str(run_dir)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 4, result.output
    (line,) = error_lines(result)
    checkpoints = run_dir / "checkpoints"
    assert f"no space left on device writing {checkpoints / 'step-00000006.pt'}; the run stops" in line
    assert f"the last good checkpoint is {checkpoints / 'step-00000004.pt'} (step 4)" in line
    assert line.endswith(f"`distrain run --resume {run_dir}`")
    assert "(summary.json: failed)" in line and json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest.json", "step-00000002.pt", "step-00000004.pt"]
    assert latest_checkpoint(checkpoints) == checkpoints / "step-00000004.pt"
    monkeypatch.setattr(torch, "save", real_save)
    assert load_checkpoint(checkpoints / "step-00000004.pt")["global_step"] == 4  # whole: --resume goes on from it
