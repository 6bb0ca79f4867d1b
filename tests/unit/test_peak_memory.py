"""Per-worker peak memory (orchestrator/peak_memory.py): ru_maxrss's units, the sample a step row takes, the
reset a warm worker gets, and the summary's figures from the rows."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest

from distrain.orchestrator import peak_memory
from distrain.orchestrator.metrics import SCHEMA, MetricsSink
from distrain.orchestrator.peak_memory import PeakMemory, host_peak_bytes, maxrss_bytes
from distrain.orchestrator.summary import peak_memory_figures
from distrain.orchestrator.worker import STEP_COLUMNS

MiB = 2**20


def test_maxrss_is_kib_on_linux_and_bytes_on_macos():
    assert maxrss_bytes(2048, "linux") == 2 * MiB
    assert maxrss_bytes(2048, "freebsd14") == 2 * MiB
    assert maxrss_bytes(2 * MiB, "darwin") == 2 * MiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_host_peak_is_the_kernels_high_water_mark_in_bytes():
    """The figure /proc/self/status calls VmHWM (in kB): the two read the kernel's counters at slightly
    different moments (per-CPU RSS counters), so within a few per cent; in KiB it would be 1/1024 of it."""

    def vmhwm() -> int:
        line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    mark, peak = vmhwm(), host_peak_bytes()
    assert abs(peak - mark) <= 0.05 * mark


def test_a_sample_grows_with_an_allocation_and_has_no_gpu_figure_on_the_cpu():
    meter = PeakMemory("cpu")
    first = meter.sample()
    block = np.ones(64 * MiB // 8)  # 64 MiB, touched
    second = meter.sample()
    del block
    third = meter.sample()
    assert first["gpu_peak_bytes"] is None and second["gpu_peak_bytes"] is None
    assert second["mem_peak_bytes"] >= first["mem_peak_bytes"] + 60 * MiB
    assert third["mem_peak_bytes"] == second["mem_peak_bytes"]  # a peak: freeing does not lower it


def test_a_warm_workers_peak_starts_again_at_its_build(monkeypatch, tmp_path):
    """A new PeakMemory (each TrainWorker build, a warm worker's rebuild too) sets the kernel's mark back."""
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/clear_refs is Linux's")
    block = np.ones(96 * MiB // 8)
    high = host_peak_bytes()
    del block
    try:
        peak_memory.CLEAR_REFS.write_text(peak_memory.RESET_HIGH_WATER)
    except OSError:
        pytest.skip("this kernel or container does not let a process reset its peak RSS")
    block = np.ones(96 * MiB // 8)  # high again, then the worker of the next run is built
    del block
    assert PeakMemory("cpu").sample()["mem_peak_bytes"] <= high - 64 * MiB
    # Where the file cannot be written, building a worker still works (the whole-life peak stands).
    monkeypatch.setattr(peak_memory, "CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    assert PeakMemory("cpu").sample()["mem_peak_bytes"] > 0


def test_the_gpu_figure_is_the_most_seen_across_counter_resets(monkeypatch):
    """A pipeline stage resets torch's peak counter every step; the row's figure still only grows."""
    import torch

    readings = iter([300, 100, 500])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: next(readings))
    meter = PeakMemory("cuda")
    assert [meter.sample()["gpu_peak_bytes"] for _ in range(3)] == [300, 300, 500]


def test_every_step_row_has_the_columns():
    assert {"mem_peak_bytes", "gpu_peak_bytes"} <= set(STEP_COLUMNS)
    assert str(SCHEMA.field("mem_peak_bytes").type) == "int64"


def test_summary_figures_are_the_largest_worker_peak_and_each_workers():
    steps = pd.DataFrame(
        {
            "worker": [0, 1, 0, 1],
            "step": [0, 0, 1, 1],
            "mem_peak_bytes": [100, 300, 200, 300],
            "gpu_peak_bytes": [None, None, None, None],
        }
    )
    assert peak_memory_figures(steps) == {
        "peak_memory_bytes": 300,
        "peak_memory_bytes_per_worker": {"0": 200, "1": 300},
    }  # no GPU figure on a CPU run
    steps["gpu_peak_bytes"] = [10, 40, 30, 20]
    figures = peak_memory_figures(steps)
    assert figures["gpu_peak_bytes"] == 40 and figures["gpu_peak_bytes_per_worker"] == {"0": 30, "1": 40}


def test_rows_recorded_before_the_columns_existed_give_no_figures():
    """A checkpoint of an earlier version carries rows without the columns: null there, no summary key."""
    sink = MetricsSink("r")
    sink.add_rows({"run_id": ["r"], "kind": ["step"], "worker": [0], "step": [0], "loss": [1.0]})
    table = sink.table().to_pandas()
    assert table["mem_peak_bytes"].isna().all()
    assert peak_memory_figures(table) == {}
    assert peak_memory_figures(pd.DataFrame({"worker": [0], "step": [0]})) == {}
