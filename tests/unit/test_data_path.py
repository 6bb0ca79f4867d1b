"""The GPU data path (issue 29), without a GPU or Ray: the prefetched batch is pinned on the reader thread
only when asked (and only a CUDA worker asks), the batch's move to the device is timed (`h2d_s`), a PS
worker's host buffers are the trainer's own on the CPU, NVML's readings (a fake `pynvml`) reach the step
rows' `gpu_util` / `gpu_mem_bytes` and their absence is never an error, and the report shows them."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pandas as pd
import torch
from torch.utils.data import TensorDataset

from distrain.orchestrator import gpu_stats
from distrain.orchestrator.gpu_stats import GPU_COLUMNS, GpuStats, nvml_handle, read_gpu
from distrain.orchestrator.metrics import SCHEMA
from distrain.reporting.gpu import gpu_rows
from distrain.reporting.report import load_runs, render
from distrain.strategies.ps import HostStaging
from distrain.trainers import task as task_module
from distrain.trainers.task import BatchReader, DeviceCopy, Task, pins_memory
from tests.unit.test_report_plots import recorded_run


def _data(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n * 3, dtype=torch.float32).reshape(n, 3), torch.arange(n))


# ---------------------------------------------------------------------- pinning and the copy
def test_the_pin_decision_needs_a_cuda_device_and_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pins_memory("cuda") and not pins_memory("cuda:1") and not pins_memory("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pins_memory("cuda") and pins_memory(torch.device("cuda:0"))
    assert not pins_memory("cpu")


def test_an_unpinned_reader_prefetches_as_before():
    data = _data()
    reader = BatchReader(data, Task().collate, prefetch=True, pin=False)
    order = [np.array([3, 1]), np.array([0, 9, 4]), np.array([7])]
    got = []
    for i, idx in enumerate(order):
        batch = reader.read(idx)
        if i + 1 < len(order):
            reader.prefetch(order[i + 1])
        got.append(batch)
    reader.close()
    for idx, (x, y) in zip(order, got, strict=True):
        assert torch.equal(x, data.tensors[0][idx]) and torch.equal(y, data.tensors[1][idx])
        assert not x.is_pinned() and not y.is_pinned()


def test_a_pinning_reader_pins_the_prefetched_batch_on_its_thread(monkeypatch):
    calls = []

    def fake_pinned(batch):  # pin_memory itself raises without CUDA: record where it would run
        calls.append(threading.current_thread().name)
        return ("pinned", batch)

    monkeypatch.setattr(task_module, "pinned", fake_pinned)
    reader = BatchReader(_data(), Task().collate, prefetch=True, pin=True)
    first = reader.read(np.array([0, 1]))  # read on the training thread: not pinned
    assert calls == [] and torch.is_tensor(first[0])
    reader.prefetch(np.array([2, 3]))
    tag, (x, _) = reader.read(np.array([2, 3]))
    reader.close()
    assert tag == "pinned" and calls == ["distrain-prefetch"]
    assert torch.equal(x, _data().tensors[0][[2, 3]])


def test_the_device_copy_on_the_cpu_is_timed_and_moves_nothing():
    copy = DeviceCopy("cpu")
    assert not copy.cuda
    x, y = torch.ones(4, 3), torch.arange(4)
    moved = copy.move((x, {"y": y}))
    assert moved[0] is x and moved[1]["y"] is y  # already on the device: the same tensors
    assert 0.0 <= copy.seconds() < 1.0


def test_h2d_s_and_the_gpu_columns_are_in_the_metrics_schema():
    names = SCHEMA.names
    assert names.index("h2d_s") == names.index("comm_s") + 1
    assert SCHEMA.field("h2d_s").type == "double"
    assert SCHEMA.field("gpu_util").type == "double" and SCHEMA.field("gpu_mem_bytes").type == "int64"
    assert set(GPU_COLUMNS) <= set(names)


def test_a_ps_worker_on_the_cpu_stages_through_the_trainers_own_buffers():
    trainer = types.SimpleNamespace(params_flat=torch.zeros(6), grads_flat=torch.arange(6.0))
    host = HostStaging(trainer)
    assert not host.pinned
    out = host.params_out()
    out[:] = 7.0  # the shards' θ, installed in place
    host.install()
    assert torch.equal(trainer.params_flat, torch.full((6,), 7.0))
    assert host.grads_in() is trainer.grads_flat


# ---------------------------------------------------------------------- NVML
class _Handle:
    def __init__(self, key):
        self.key = key


def _fake_pynvml(util: float = 63.0, used: int = 5_000_000_000, init_error: bool = False):
    fake = types.ModuleType("pynvml")
    fake.calls = []

    def nvmlInit():
        if init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    def by_index(i):
        fake.calls.append(("index", i))
        return _Handle(i)

    def by_uuid(uuid):
        fake.calls.append(("uuid", uuid))
        return _Handle(uuid)

    fake.nvmlInit = nvmlInit
    fake.nvmlDeviceGetHandleByIndex = by_index
    fake.nvmlDeviceGetHandleByUUID = by_uuid
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=util, memory=10)
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=used, total=80_000_000_000, free=1)
    return fake


def test_gpu_stats_read_the_workers_gpu_from_nvml(monkeypatch):
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    stats = GpuStats("cuda", interval_s=3600)
    assert fake.calls == [("index", 2)]  # CUDA's device 0 is the machine's GPU 2
    assert stats.sample() == {"gpu_util": 63.0, "gpu_mem_bytes": 5_000_000_000}
    assert stats.sample() == {"gpu_util": None, "gpu_mem_bytes": None}  # within the interval: not read again


def test_gpu_stats_find_a_gpu_named_by_uuid(monkeypatch):
    fake = _fake_pynvml(util=12.0, used=1234)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    handle = nvml_handle("cuda:1")
    assert handle.key == "GPU-bbbb" and fake.calls == [("uuid", "GPU-bbbb")]
    assert read_gpu(handle) == {"gpu_util": 12.0, "gpu_mem_bytes": 1234}


def test_without_pynvml_or_nvml_the_columns_are_null_never_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    assert GpuStats("cuda").sample() == {"gpu_util": None, "gpu_mem_bytes": None}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(init_error=True))
    assert GpuStats("cuda").sample() == {"gpu_util": None, "gpu_mem_bytes": None}
    fake = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert GpuStats("cpu").sample() == {"gpu_util": None, "gpu_mem_bytes": None} and fake.calls == []


def test_a_reading_nvml_refuses_leaves_that_column_null(monkeypatch):
    fake = _fake_pynvml(used=42)

    def unsupported(handle):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # a MIG slice's utilisation

    fake.nvmlDeviceGetUtilizationRates = unsupported
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_stats.GpuStats("cuda").sample() == {"gpu_util": None, "gpu_mem_bytes": 42}


# ---------------------------------------------------------------------- the report
def _with_gpu_columns(run_dir, util, used):
    path = run_dir / "metrics.parquet"
    df = pd.read_parquet(path)
    steps = df["kind"] == "step"
    df.loc[steps, "gpu_util"] = util
    df.loc[steps, "gpu_mem_bytes"] = used
    df.loc[steps, "gpu_peak_bytes"] = 2_000_000_000
    df.loc[steps, "h2d_s"] = 0.0005
    df.to_parquet(path)


def test_the_report_shows_gpu_utilisation_and_memory_where_recorded(tmp_path):
    gpu = recorded_run(tmp_path, "gpu", 5.0)
    _with_gpu_columns(gpu, util=[50.0, 70.0] * 40, used=[3_000_000_000, 4_500_000_000] * 40)
    cpu = recorded_run(tmp_path, "cpu", 5.0)
    runs = load_runs([gpu, cpu])
    assert gpu_rows(runs) == [["gpu", "60", "4.5 GB", "2.0 GB", "0.500"]]  # the CPU run has no row
    text = render(runs)["report.md"].decode()
    assert "## GPUs" in text
    assert "| gpu | 60 | 4.5 GB | 2.0 GB | 0.500 |" in text


def test_a_report_of_cpu_runs_has_no_gpu_section(tmp_path):
    runs = load_runs([recorded_run(tmp_path, "cpu", 5.0)])
    assert gpu_rows(runs) == []
    assert "## GPUs" not in render(runs)["report.md"].decode()
