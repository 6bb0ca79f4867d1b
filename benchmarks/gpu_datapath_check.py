"""The GPU data path of issue 29, checked on a machine with one CUDA GPU (no Ray needed).

A prefetched batch arrives pinned (read on the reader thread) and its move to the device is timed by
CUDA events (`h2d_s` > 0); a parameter-server worker's host buffers are pinned and carry θ to the
device and the gradient back unchanged; NVML (`nvidia-ml-py`) reads the GPU's utilisation and memory in
use. Exits non-zero on the first failed check.

    python benchmarks/gpu_datapath_check.py

Not part of the test suite (CI has no GPU).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

try:
    import distrain  # noqa: F401  (installed)
except ImportError:  # a bare checkout: the repository root is the package, whatever the folder's name
    import tempfile

    link_dir = Path(tempfile.mkdtemp())
    (link_dir / "distrain").symlink_to(Path(__file__).resolve().parents[1])
    sys.path.insert(0, str(link_dir))
try:
    import ray  # noqa: F401
except ImportError:  # the GPU image has no Ray; only the worker-side code runs here, never a Ray call
    sys.modules["ray"] = types.ModuleType("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from distrain.orchestrator.gpu_stats import GpuStats  # noqa: E402
from distrain.strategies.ps import HostStaging  # noqa: E402
from distrain.trainers.task import BatchReader, DeviceCopy, Task, pins_memory  # noqa: E402


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    check(torch.cuda.is_available(), f"torch {torch.__version__} sees CUDA")
    check(pins_memory("cuda") and not pins_memory("cpu"), "pins_memory: cuda yes, cpu no")
    data = TensorDataset(torch.randn(4096, 3, 64, 64), torch.arange(4096))
    reader = BatchReader(data, Task().collate, prefetch=True, pin=True)
    copy = DeviceCopy("cuda")
    first = reader.read(np.arange(256))
    reader.prefetch(np.arange(256, 512))
    check(not first[0].is_pinned(), "a batch read on the training thread is not pinned")
    x, y = reader.read(np.arange(256, 512))
    check(x.is_pinned() and y.is_pinned(), "the prefetched batch is pinned")
    gx, gy = copy.move((x, y))
    seconds = copy.seconds()
    check(gx.is_cuda and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y), "the batch reached the GPU intact")
    check(0 < seconds < 1, f"h2d_s {seconds * 1e3:.3f} ms for {x.nbytes / 1e6:.1f} MB (CUDA events)")
    reader.close()

    trainer = types.SimpleNamespace(
        params_flat=torch.zeros(1000, device="cuda"), grads_flat=torch.randn(1000, device="cuda")
    )
    host = HostStaging(trainer)
    check(host.pinned and host.params.is_pinned() and host.grads.is_pinned(), "PS staging buffers are pinned")
    host.params_out()[:] = np.arange(1000, dtype=np.float32)  # the shards' θ
    host.install()
    out = host.params_out()  # waits for the copy before the buffer may be written again
    check(torch.equal(trainer.params_flat.cpu(), torch.arange(1000.0)), "θ installed on the GPU")
    out[:] = 0.0
    check(torch.equal(host.grads_in(), trainer.grads_flat.cpu()), "the gradient staged on the host")

    stats = GpuStats("cuda")
    check(stats.handle is not None, "NVML handle for cuda (pynvml imported, nvmlInit ran)")
    torch.cuda.synchronize()
    reading = stats.sample()
    print(f"     {reading}")
    check(reading["gpu_util"] is not None and 0 <= reading["gpu_util"] <= 100, "gpu_util read")
    check(reading["gpu_mem_bytes"] is not None and reading["gpu_mem_bytes"] > 0, "gpu_mem_bytes read")
    check(stats.sample() == {"gpu_util": None, "gpu_mem_bytes": None}, "not read again within the interval")


if __name__ == "__main__":
    main()
