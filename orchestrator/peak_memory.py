"""A worker's peak memory so far, for every step row: `mem_peak_bytes` (host) and `gpu_peak_bytes` (device).

`mem_peak_bytes` is the worker process's peak resident set size, the high-water mark the kernel keeps
(`getrusage(RUSAGE_SELF).ru_maxrss`, what `/usr/bin/time -v` reports: one system call per step). It counts
everything the process holds, torch's shared libraries and the data set included, so it is what the
host must give each worker, not the training state alone (`mem_param_bytes` and its siblings count
that where a strategy records them). `gpu_peak_bytes`, on a CUDA device, is the most torch's caching
allocator has handed out to tensors (`torch.cuda.max_memory_allocated`), the figure `--worker-memory`
budgets a GPU by; null on the CPU. Both only grow over one worker process's steps (a replacement
after a failure is a new process).

A warm worker (orchestrator/warm_pool.py) is a process reused from an earlier run: on Linux its
high-water mark is set back to the memory it holds now when it is built for the run
(`/proc/self/clear_refs`), so a sweep's trials do not inherit the largest earlier trial's peak. Where that
file cannot be written the peak is the process's since it started (the docs say so). GPU workers are never
kept warm. No Ray here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # not on Windows: the host column stays null there
    resource = None  # type: ignore[assignment]

# Columns of every step row, in metrics.parquet's order (orchestrator/metrics.py SCHEMA).
PEAK_COLUMNS = {
    "mem_peak_bytes": "int64",  # the worker process's peak resident memory so far (host)
    "gpu_peak_bytes": "int64",  # its peak CUDA memory allocated to tensors so far; null on the CPU
}
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_HIGH_WATER = "5"  # Linux >= 4.0: sets the peak RSS (VmHWM, ru_maxrss) back to the current RSS


def maxrss_bytes(maxrss: int, platform: str = sys.platform) -> int:
    """`ru_maxrss` in bytes: Linux (and the BSDs) report it in KiB, macOS in bytes."""
    return maxrss if platform == "darwin" else maxrss * 1024


def host_peak_bytes() -> int | None:
    """This process's peak resident memory so far, in bytes (None where getrusage is missing)."""
    if resource is None:
        return None
    return maxrss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


class PeakMemory:
    """One worker's peak memory, sampled after each step."""

    def __init__(self, device: str) -> None:
        self.on_gpu = device.startswith("cuda")
        self.gpu_peak = 0  # the most seen: a pipeline resets torch's counter every step (strategies/pipeline.py)
        _reset_high_water()

    def sample(self) -> dict[str, Any]:
        """This step's row's values of `PEAK_COLUMNS`."""
        gpu = None
        if self.on_gpu:
            import torch

            self.gpu_peak = gpu = max(self.gpu_peak, int(torch.cuda.max_memory_allocated()))
        return {"mem_peak_bytes": host_peak_bytes(), "gpu_peak_bytes": gpu}


def _reset_high_water() -> None:
    """Forget an earlier run's peak in a reused process, where the kernel allows it (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        CLEAR_REFS.write_text(RESET_HIGH_WATER)
    except OSError:  # an older kernel, a locked-down container: the process's whole-life peak stands
        pass
