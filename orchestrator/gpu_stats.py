"""A CUDA worker's GPU utilisation and memory, read from NVML (`nvidia-ml-py`, the `gpu` extra).

`gpu_util` is the GPU's utilisation as NVML reports it (`nvmlDeviceGetUtilizationRates(...).gpu`: the
percentage of the last sample period, ~1/6 s to 1 s by the driver, in which some kernel ran) and
`gpu_mem_bytes` the device memory in use (`nvmlDeviceGetMemoryInfo(...).used`: every process's and the
driver's, not only torch's tensors, unlike `gpu_peak_bytes`). Both are read at most once every
`INTERVAL_S` seconds (a read costs tens of microseconds): the step rows in between have nulls, as every
row has on the CPU, without `pynvml`, or where NVML cannot be initialised or read (a MIG slice reports no
utilisation). Nothing here raises. No Ray here.
"""

from __future__ import annotations

import os
import time
from typing import Any

# Columns of every step row, in metrics.parquet's order (orchestrator/metrics.py SCHEMA).
GPU_COLUMNS = {
    "gpu_util": "float64",  # the worker's GPU's utilisation, percent (NVML); null between reads and off CUDA
    "gpu_mem_bytes": "int64",  # the device memory in use on that GPU, bytes (NVML); likewise
}
INTERVAL_S = 1.0  # the least time between two reads
NONE = {name: None for name in GPU_COLUMNS}


def nvml_handle(device: str) -> Any:
    """The NVML handle of the GPU `device` ("cuda" or "cuda:N") names, or None (not CUDA, no `pynvml`,
    NVML not initialised). NVML numbers the machine's GPUs, CUDA only the visible ones: the index is
    looked up in CUDA_VISIBLE_DEVICES (Ray sets it per actor), by number or by UUID."""
    if not device.startswith("cuda"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if index < len(visible):
            entry = visible[index]
            if not entry.isdigit():  # GPU-<uuid> (or MIG-<uuid>)
                return pynvml.nvmlDeviceGetHandleByUUID(entry)
            index = int(entry)
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 - no pynvml, no driver, no such device: no readings, never an error
        return None


def read_gpu(handle: Any) -> dict[str, Any]:
    """`GPU_COLUMNS`' values for the GPU behind `handle` now (None each where it cannot be read)."""
    if handle is None:
        return dict(NONE)
    import pynvml

    values = dict(NONE)
    try:
        values["gpu_util"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # noqa: BLE001 - e.g. NVML_ERROR_NOT_SUPPORTED on a MIG slice
        pass
    try:
        values["gpu_mem_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # noqa: BLE001
        pass
    return values


class GpuStats:
    """One worker's GPU readings for its step rows: one read every `interval_s`, nulls in between."""

    def __init__(self, device: str, interval_s: float = INTERVAL_S) -> None:
        self.handle = nvml_handle(device)
        self.interval_s = interval_s
        self.last = -float("inf")  # time.monotonic() of the last read

    def sample(self) -> dict[str, Any]:
        """This step row's values of `GPU_COLUMNS`."""
        if self.handle is None:
            return dict(NONE)
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return dict(NONE)
        self.last = now
        return read_gpu(self.handle)
