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
import math
import textwrap

import pandas as pd
import pyarrow as pa
import pytest

from distrain.cli import print_summary
from distrain.config import SKIPPED_SHARE_LIMIT, RunConfig
from distrain.errors import RunFailed
from distrain.orchestrator import outcome
from distrain.orchestrator.files import NoSpace, atomic_write
from distrain.orchestrator.metrics import MetricsSink
from distrain.orchestrator.summary import summarize


def table(steps: list[dict], evals: list[dict] | None = None) -> pa.Table:
    """A metrics table as the driver's sink holds it: step rows, then evaluation rows."""
    sink = MetricsSink("r")
    for row in steps:
        sink.add_steps({k: [v] for k, v in row.items()})
    for i, metrics in enumerate(evals or []):
        # the test set's columns, as a run recorded before the validation split (or one validating on test)
        columns = {f"test_{k}": v for k, v in metrics.items()}
        sink.add_eval(i, 10 * (i + 1), columns, wall_time=float(100 + i), eval_s=0.1)
    return sink.table()


def step(n: int, worker: int = 0, nonfinite: bool | None = None, overflow: bool | None = None) -> dict:
    return {"worker": worker, "step": n, "epoch": 0, "loss": 1.0, "samples": 8, "compute_s": 0.01, "comm_s": 0.0,
            "bytes_sent": 100, "wall_time": float(n), "nonfinite": nonfinite, "overflow": overflow}  # fmt: skip


# ---------------------------------------------------------------- item 1: the rule, on plain rows
def test_the_skipped_share_counts_global_steps_and_leaves_fp16_overflows_out():
    rows = [step(s, w, nonfinite=True) for s in (3, 4) for w in (0, 1)]  # 2 steps skipped by both workers
    rows += [step(s, 0, nonfinite=True, overflow=True) for s in (5, 6, 7)]  # fp16's scale overflowing: normal
    rows += [step(s, w) for s in range(8, 20) for w in (0, 1)]
    assert outcome.skipped_steps(table(rows)) == 2
    assert outcome.judge(table(rows, [{"loss": 0.5}]), updates=20) is None  # 2 of 20: 10%, not more
    assert outcome.judge(table(rows, [{"loss": 0.5}]), updates=19) == {
        "reason": "skipped_share", "skipped": 2, "updates": 19, "limit": SKIPPED_SHARE_LIMIT,
    }  # fmt: skip
    assert SKIPPED_SHARE_LIMIT == 0.10


def test_a_final_evaluation_that_is_not_finite_diverges_and_a_metric_never_reported_does_not():
    rows = [step(s) for s in range(10)]
    assert outcome.judge(table(rows, [{"loss": 0.4, "accuracy": 0.8}, {"loss": math.nan, "accuracy": 0.1}]), 10) == {
        "reason": "final_eval_nonfinite", "metrics": ["test_loss"],
    }  # fmt: skip
    inf = table(rows, [{"loss": math.inf, "mae": math.nan}])
    assert outcome.judge(inf, 10) == {"reason": "final_eval_nonfinite", "metrics": ["test_loss", "test_mae"]}
    # an earlier NaN evaluation that recovered is not the final one; a task without accuracy has no null to judge
    assert outcome.judge(table(rows, [{"loss": math.nan}, {"loss": 0.3}]), 10) is None
    assert outcome.final_evaluation(table(rows, [{"loss": 0.3}])) == {"test_loss": 0.3}
    assert outcome.judge(table(rows), 10) is None  # no evaluation at all (--eval-every 0 and stopped early)


def test_each_diverged_reason_is_one_line_that_says_why_and_what_to_do():
    skipped = outcome.diverged_line({"reason": "skipped_share", "skipped": 21, "updates": 22, "limit": 0.1})
    assert "21 of 22 updates (95%) were skipped as non-finite under --on-nonfinite skip" in skipped
    assert "more than 10%" in skipped and "lower --lr" in skipped
    final = outcome.diverged_line({"reason": "final_eval_nonfinite", "metrics": ["test_loss"]})
    assert "final evaluation's test_loss is not finite" in final and "lower --lr" in final
    stop = outcome.diverged_line({"reason": "nonfinite", "step": 3, "worker": 1, "what": "loss or gradient"})
    assert stop.startswith("training diverged at step 3 (worker 1's loss or gradient not finite)")
    assert all("\n" not in line for line in (skipped, final, stop))


def test_a_test_loss_that_ends_above_its_first_evaluation_is_a_warning():
    evals = pd.DataFrame({"test_loss": [0.9, 0.5, 2.6]})
    (line,) = outcome.warnings(evals)
    assert "final test loss (2.6) is above the first evaluation's (0.9)" in line
    assert outcome.warnings(pd.DataFrame({"test_loss": [0.9, 1.2, 0.4]})) == []  # got worse, then better
    assert outcome.warnings(pd.DataFrame({"test_loss": [0.9]})) == []  # one evaluation: nothing to compare
    assert outcome.warnings(pd.DataFrame({"test_loss": [0.9, math.nan]})) == []  # not finite: diverged instead


# ---------------------------------------------------------------- item 4: summary.json keys that apply
def summary_of(config: RunConfig, rows: list[dict], evals: list[dict]) -> dict:
    from distrain.orchestrator.tasks import build_task, run_target

    df = table(rows, evals).to_pandas()
    target = run_target(config, build_task(config)) if not config.task else None
    return summarize(df, config.to_dict(), 0.0, 1.0, "completed", 1, target)


def test_summary_json_has_no_keys_that_do_not_apply_to_the_run():
    rows = [step(s, w) for s in range(10) for w in (0, 1)]
    bsp = summary_of(RunConfig(model="mlp"), rows, [{"loss": 0.5, "accuracy": 0.5}, {"loss": 0.6, "accuracy": 0.6}])
    for key in ("staleness_p95", "wait_s_total", "bytes_pushed_per_step", "averaging_rounds", "tau_changes",
                "compress", "codec_ratio", "diverged", "overflow_steps"):  # fmt: skip
        assert key not in bsp, key
    assert None not in [v for k, v in bsp.items() if k != "time_to_target_s"]  # null only where it means something
    assert bsp["time_to_target_s"] is None and bsp["target"] == "val_accuracy>=0.95"  # applies: not reached
    assert bsp["warnings"] == [outcome.warnings(pd.DataFrame({"test_loss": [0.5, 0.6]}))[0]]
    ps_rows = [dict(r, staleness=1, wait_s=0.1, bytes_received=100) for r in rows]
    ps = summary_of(RunConfig(model="mlp", strategy="ssp", precision="fp16"), ps_rows, [{"loss": 0.5}])
    assert ps["staleness_p95"] == 1.0 and ps["bytes_pulled_per_step"] == 100.0 and ps["overflow_steps"] == 0
    codec = summary_of(RunConfig(model="mlp", compress="int8"), rows, [{"loss": 0.5}])
    assert codec["compress"] == "int8" and codec["codec_ratio"] is None  # applies; nothing compressed yet


def test_a_user_task_without_a_target_has_no_classification_or_target_keys(tmp_path):
    path = tmp_path / "task.py"
    path.write_text(textwrap.dedent(REGRESSION))
    config = RunConfig(task=f"{path}:Plain")
    summary = summary_of(config, [step(s) for s in range(4)], [{"loss": 0.2, "mae": 0.1}])
    for key in ("model", "dataset", "best_test_accuracy", "target_accuracy", "target", "time_to_target_s"):
        assert key not in summary, key
    assert summary["final_test_mae"] == 0.1 and "final_test_accuracy" not in summary


CLOSING_SUMMARY = {"run_id": "r", "status": "completed", "strategy": "ssp", "workers": 2, "model": "mlp",
    "dataset": "digits", "epochs_completed": 1, "steps_completed": 22, "final_test_accuracy": 0.9,
    "wall_time_s": 3.0, "steady_state_samples_per_s": 1000.0, "bytes_per_step": 680016.0,
    "mean_compute_s": 0.001, "mean_comm_s": 0.001, "staleness_p50": 1.0, "staleness_p95": 2.0,
    "staleness_max": 3, "wait_s_total": 0.5, "bytes_pushed_per_step": 12_345_678.0,
    "bytes_pulled_per_step": 999.0, "warnings": ["the final test loss (2.6) is above ..."]}  # fmt: skip


def test_the_closing_summary_says_not_reached_and_prints_bytes_in_units(capsys, tmp_path):
    base = CLOSING_SUMMARY
    print_summary(base | {"target": "test_accuracy>=0.95", "time_to_target_s": None}, tmp_path)
    text = capsys.readouterr().out
    assert "not reached" in text and "- s" not in text
    assert "680.0 kB" in text and "12.3 MB / 999 B" in text and "680,016" not in text
    assert "warning: the final test loss (2.6) is above ..." in text
    print_summary(base, tmp_path)  # no target: no row for it
    assert "time to" not in capsys.readouterr().out


def test_the_closing_line_names_only_the_files_the_run_left(capsys, tmp_path):
    base = CLOSING_SUMMARY | {"status": "diverged", "warnings": []}
    for name in ("config.yaml", "summary.json"):
        (tmp_path / name).write_text("")
    print_summary(base, tmp_path)  # a diverged run: no metrics yet, no checkpoints/ (it used to name it)
    assert capsys.readouterr().out.splitlines()[-1] == f"results in {tmp_path}/ (config.yaml, summary.json)"
    (tmp_path / "metrics.parquet").write_text("")
    (tmp_path / "checkpoints").mkdir()
    print_summary(base, tmp_path)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"results in {tmp_path}/ (config.yaml, metrics.parquet, summary.json, checkpoints/)"


# ---------------------------------------------------------------- item 3: a full disk, on plain files
def test_a_full_disk_is_no_space_naming_the_file_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "step-00000006.pt"
    target.write_bytes(b"the previous checkpoint")

    def torch_like(tmp):  # torch.save through a file: its RuntimeError carries the OSError as its context
        with open(tmp, "wb") as f:
            f.write(b"half a checkpoint")
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos") from None  # noqa: B904

    for write in (torch_like, _raise(OSError(errno.EDQUOT, "Disk quota exceeded"))):
        with pytest.raises(NoSpace) as info:
            atomic_write(target, write)
        assert info.value.filename == str(target) and info.value.errno == errno.ENOSPC
        assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained tracebacks
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006.pt"]  # the partial file is gone
        assert target.read_bytes() == b"the previous checkpoint"
    with pytest.raises(PermissionError):  # any other error stays what it is
        atomic_write(target, _raise(PermissionError(errno.EACCES, "Permission denied")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006.pt"]


def _raise(error: Exception):
    def write(tmp):
        raise error

    return write


def test_the_no_space_line_says_what_was_kept_and_what_was_not(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-00000004.pt"
    line = outcome.no_space_line(str(tmp_path / "checkpoints/step-00000006.pt"), ckpt, 4, tmp_path, True, True)
    assert line.startswith(f"no space left on device writing {tmp_path}/checkpoints/step-00000006.pt; the run stops")
    assert "(summary.json: failed)" in line and f"the last good checkpoint is {ckpt} (step 4)" in line
    assert line.endswith(f"`distrain run --resume {tmp_path}`")
    full = outcome.no_space_line("summary.json", None, 0, tmp_path, False, True)
    assert "no room to mark it failed in summary.json either (it still says unfinished)" in full
    assert "nothing to resume" in full and "--resume" not in full


# ---------------------------------------------------------------- tiny real runs through the CLI
REGRESSION = """
    import os
    import time

    import torch
    from torch.utils.data import TensorDataset

    import distrain


    def in_a_worker():
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


    class Plain(distrain.Task):
        def __init__(self, n=256):
            self.n, self.calls = n, 0

        def build_model(self):
            return torch.nn.Linear(4, 1)

        def datasets(self):
            g = torch.Generator().manual_seed(0)
            x = torch.randn(self.n, 4, generator=g)
            y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
            return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])

        def loss(self, model, batch):
            x, y = batch
            return ((model(x).squeeze(-1) - y) ** 2).mean()

        def metrics(self, model, batch):
            x, y = batch
            return {"mae": (model(x).squeeze(-1) - y).abs().mean().item()}


    class ExitsAtStep3(Plain):
        '''The user's code ends its own process at its third training step (in a worker, every attempt).'''

        def loss(self, model, batch):
            self.calls += 1
            if self.calls == 3 and in_a_worker():
                os._exit(3)
            return super().loss(model, batch)
"""








@pytest.mark.parametrize("summary_fits", [True, False], ids=["summary-written", "summary-full-too"])
def test_the_driver_records_a_full_disk_where_it_fits_and_says_what_it_could_not(tmp_path, monkeypatch, summary_fits):
    """`_Driver._no_space` on a stand-in driver (no Ray): summary.json first (small, it says `failed`),
    then the metrics; a write that finds no room either is said in the line, never raised."""
    from types import SimpleNamespace

    from distrain.orchestrator import run as run_module
    from distrain.orchestrator.recovery import RestorePoint

    (tmp_path / "summary.json").write_text('{"status": "unfinished"}')
    real_write, ended = run_module.atomic_write_text, []

    def write_text(path, text):  # a full disk, as atomic_write reports it
        if not summary_fits:
            raise NoSpace(path)
        real_write(path, text)

    def write_metrics(path):
        raise NoSpace(path)  # no room for the metrics either: the older file stays as it was

    monkeypatch.setattr(run_module, "atomic_write_text", write_text)
    driver = SimpleNamespace(
        steps_done=6, steps_per_epoch=4, run_dir=tmp_path, _summary=lambda status, epochs: {"status": status},
        sink=SimpleNamespace(write=write_metrics), hooks=SimpleNamespace(end=lambda s, quiet: ended.append(s)),
        state=SimpleNamespace(point=RestorePoint(None, 4, 1.0, tmp_path / "checkpoints" / "step-00000004.pt")),
    )  # fmt: skip
    error = run_module._Driver._no_space(driver, NoSpace(tmp_path / "checkpoints" / "step-00000006.pt"))
    line = str(error)
    assert isinstance(error, RunFailed) and error.exit_code == 4 and ended == [{"status": "failed"}]
    assert "step-00000006.pt" in line and "step-00000004.pt (step 4)" in line and "\n" not in line
    status = json.loads((tmp_path / "summary.json").read_text())["status"]
    if summary_fits:
        assert status == "failed" and "(summary.json: failed)" in line
    else:
        assert status == "unfinished" and "no room to mark it failed in summary.json either (it still says" in line


