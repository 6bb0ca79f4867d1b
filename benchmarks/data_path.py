"""The data path of issue 14: a worker's resident memory with a training set far larger than it, and
what the background prefetch thread does to throughput on this machine.

1. Memory: a ~2 GB float32 training set in one file, read through `np.memmap` by index (only the
   rows a step needs are touched; the pages read are released again with madvise(MADV_DONTNEED), so
   the mapping never becomes resident). Two workers train a linear classifier on it for --steps
   steps; each reports its own peak RSS (VmHWM from /proc/self/status) through the task's metrics.
   Target: per-worker peak RSS < 600 MB. For scale, the same run measures the floor: a Ray actor
   that imports torch and builds one torch optimizer (which imports torch._dynamo, and with it
   triton, on this CUDA build), with no distrain and no data in it.
2. Prefetch: the default task (cnn on digits, 2 workers) with --prefetch and --no-prefetch,
   interleaved over --rounds rounds, steady-state samples/s from summary.json; median and spread.

    python benchmarks/data_path.py [--gb 2] [--steps 400] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import distrain

DIM = 256  # float32 features per row: 1 KiB a row


class MemmapRows(torch.utils.data.Dataset):
    def __init__(self, path: str, rows: int, start: int, stop: int) -> None:
        self.path, self.rows, self.start, self.stop = path, rows, start, stop
        self._x: np.memmap | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int):
        return self.get_batch(np.array([i]))

    def get_batch(self, indices: np.ndarray):
        if self._x is None:  # opened lazily, in the worker's process (the object is pickled without it)
            self._x = np.memmap(self.path, dtype=np.float32, mode="r", shape=(self.rows, DIM + 1))
        rows = np.sort(np.asarray(indices) + self.start)
        block = np.array(self._x[rows])  # a copy: the rows leave the mapping
        self._x._mmap.madvise(mmap.MADV_DONTNEED)  # and the pages read are dropped from this process
        x = torch.from_numpy(block[:, :DIM])
        y = torch.from_numpy(block[:, DIM].astype(np.int64))
        return x, y

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_x"} | {"_x": None}


class MemmapTask(distrain.Task):
    """A linear classifier over rows of a large float32 file (last column: the label, 0 or 1)."""

    default_target = "val_accuracy>=0.9"

    def __init__(self, path: str, rows: int):
        self.path, self.rows = path, rows

    def build_model(self):
        return nn.Linear(DIM, 2)

    def datasets(self):
        cut = self.rows - 4096
        return MemmapRows(self.path, self.rows, 0, cut), MemmapRows(self.path, self.rows, cut, self.rows)

    def loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def metrics(self, model, batch):
        x, y = batch
        return {
            "accuracy": (float((model(x).argmax(1) == y).sum()), float(len(y))),
            # one figure per call, averaged over the calls (and so over the workers)
            "worker_peak_rss_mb": (_status_mb("VmHWM"), 1.0),
            "worker_anon_rss_mb": (_status_mb("RssAnon"), 1.0),
        }


def _status_mb(key: str) -> float:
    """A memory figure of this process from /proc/self/status, in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def torch_floor_mb() -> dict[str, float]:
    """Peak and private RSS of a Ray actor that only imports torch and builds an optimizer: what any
    torch training process on this machine holds before it has a model of note or a sample."""
    import ray

    @ray.remote(num_cpus=1)
    def floor() -> dict[str, float]:
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # first optimizer: imports torch._dynamo
        return {"peak": _status_mb("VmHWM"), "anon": _status_mb("RssAnon")}

    return ray.get(floor.remote())


def write_file(path: Path, gb: float) -> int:
    rows = int(gb * 2**30 / ((DIM + 1) * 4))
    w = np.random.default_rng(0).normal(size=DIM).astype(np.float32)
    out = np.memmap(path, dtype=np.float32, mode="w+", shape=(rows, DIM + 1))
    chunk = 65536
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        x = np.random.default_rng(start).normal(size=(n, DIM)).astype(np.float32)
        out[start : start + n, :DIM] = x
        out[start : start + n, DIM] = (x @ w > 0).astype(np.float32)
    out.flush()
    del out
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    a = ap.parse_args()

    from distrain.orchestrator.cluster import start_local_ray

    start_local_ray(num_cpus=4)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        # The same task on a 2 GB file and on a 16 MB one: what the size of the data set adds.
        print("| training set | per-worker peak RSS (VmHWM) | private (RssAnon) at the end | test accuracy |")
        print("|---|---|---|---|")
        base = torch_floor_mb()
        print(f"| none: a Ray actor that imported torch and built an optimizer | {base['peak']:.0f} MB "
              f"| {base['anon']:.0f} MB | |")  # fmt: skip
        for gb in (a.gb, 1 / 64):
            path = Path(tmp) / f"train-{gb:g}.f32"
            t0 = time.perf_counter()
            rows = write_file(path, gb)
            size_gb = path.stat().st_size / 2**30
            written = time.perf_counter() - t0
            result = distrain.fit(
                task=f"{Path(__file__).resolve()}:MemmapTask",
                task_args={"path": str(path), "rows": rows},
                max_steps=a.steps,
                eval_every=0,
                run_dir=str(Path(tmp) / f"memmap-run-{gb:g}"),
                progress=False,
            )
            m = result.metrics
            print(
                f"| {size_gb:.3f} GiB memmapped, {rows:,} rows (written in {written:.0f} s) | "
                f"{m['test_worker_peak_rss_mb']:.0f} MB | {m['test_worker_anon_rss_mb']:.0f} MB | "
                f"{m['test_accuracy']:.3f} |"
            )
            path.unlink()

        speeds: dict[bool, list[float]] = {True: [], False: []}
        for r in range(a.rounds):
            for prefetch in (True, False) if r % 2 == 0 else (False, True):
                res = distrain.fit(prefetch=prefetch, run_dir=str(Path(tmp) / f"p{prefetch}-{r}"), progress=False)
                speeds[prefetch].append(res.summary["steady_state_samples_per_s"])
        for prefetch, values in speeds.items():
            spread = f"{min(values):,.0f}-{max(values):,.0f}"
            print(
                f"| prefetch {'on ' if prefetch else 'off'} | median {statistics.median(values):,.0f} samples/s "
                f"| range {spread} | rounds {len(values)} |"
            )
        on, off = statistics.median(speeds[True]), statistics.median(speeds[False])
        print(f"prefetch on / off: {on / off:.2f}x")


if __name__ == "__main__":
    main()
