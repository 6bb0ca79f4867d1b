"""Where a BSP step's milliseconds go: distrain's worker against a torchrun DDP rank (issue 32).

    .venv/bin/python benchmarks/bsp_step_profile.py [--model cnn] [--steps 1000] [--py-spy /tmp/pyspy/bin/py-spy]

Runs the two contenders of `bsp_throughput.py` once each (torchrun DDP first, then distrain BSP on a
local Ray started here as that harness does), with the same model, data, batch and steps, and reports:

  * the step: the median time between consecutive step ends (slowest rank), and distrain's own split of
    it from its step rows (`compute_s`: read + forward + backward; `comm_s`: the wait for the all-reduce;
    the rest: update, checks and the row);
  * CPU: every process's CPU seconds over the steady window (the steps after the first 10 %), grouped
    (training ranks, the driver, raylet, GCS, Ray's agents, anything else on the machine), per step, and
    each training rank's nice value. On a 2-core machine with two ranks busy, whatever else runs is
    taken from the ranks;
  * with `--py-spy PATH`: a sampling profile of each training rank (`py-spy record --idle --threads
    --nonblocking`), its samples sorted into the phases of a step (see `PHASES`), in ms per step.
    py-spy costs CPU itself: use its figures for the split, the runs without it for the time.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
WORKER = BENCH_DIR / "_ddp_worker.py"
TICK = os.sysconf("SC_CLK_TCK")

# The phases of a step, by the innermost frame of a sample that is one of these (function, file) pairs
# (first match from the leaf up). Samples of the main thread only; the prefetch thread is counted apart.
PHASES: list[tuple[str, tuple[tuple[str, str], ...]]] = [
    ("all-reduce wait", (("finish", "strategies/collective.py"), ("wait", "strategies/channel.py"))),
    ("gradient hooks (distrain)", (("on_grad", "strategies/collective.py"), ("<lambda>", "strategies/collective.py"))),
    ("finiteness check", (("all_finite", "strategies/base.py"), ("usable_gradient", "strategies/base.py"))),
    ("optimizer step", (("apply_update", "local_trainer.py"), ("step", "torch/optim/"), ("wrapper", "torch/optim/"))),
    ("backward (DDP: with its all-reduce)", (("backward", "torch/_tensor.py"), ("_engine_run_backward", ""))),
    ("forward + loss", (("loss", "trainers/task.py"), ("_wrapped_call_impl", "torch/nn/"), ("forward", ""))),
    ("batch read", (("read", "trainers/task.py"), ("train_batch", ""), ("worker_indices", ""), ("_indices", ""))),
    ("batch move", (("move", "trainers/task.py"), ("to_device", "trainers/task.py"))),
    ("prefetch hand-off", (("prefetch", "trainers/task.py"), ("submit", "trainers/task.py"))),
    ("zero_grad / rest of compute_gradients", (("compute_gradients", ""), ("zero_grad", "torch/optim/"))),
    ("step row + loop", (("run_segment", "orchestrator/worker.py"), ("train_loop", "_ddp_worker.py"))),
]
BETWEEN = "outside the step loop (Ray, between segments)"


# ------------------------------------------------------------------------------------------ /proc
def proc_snapshot() -> dict[int, tuple[str, float, int]]:
    """pid -> (group, CPU seconds so far, nice) for every process; this process's descendants (its
    torchrun, its Ray) by what they are, everything else (other sessions' work) as one group."""
    raw = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        raw[int(entry)] = (int(fields[1]), cmd, stat[stat.index("(") + 1 : stat.rindex(")")], cpu, int(fields[16]))
    me = os.getpid()

    def mine(pid: int) -> bool:
        seen = 0
        while pid in raw and seen < 64:
            if pid == me:
                return True
            pid, seen = raw[pid][0], seen + 1
        return False

    return {
        pid: (group_of(pid, cmd, comm) if mine(pid) else "other sessions' processes", cpu, nice)
        for pid, (_, cmd, comm, cpu, nice) in raw.items()
    }


def group_of(pid: int, cmd: str, comm: str) -> str:
    if pid == os.getpid():
        return "driver (this process)"
    if "TrainWorker" in cmd or ("_ddp_worker.py" in cmd and "torch.distributed.run" not in cmd):
        return "training ranks"
    if "torch.distributed.run" in cmd:
        return "torchrun agent"
    for name in ("raylet", "gcs_server", "dashboard", "agent", "log_monitor", "monitor.py"):
        if name in cmd or name in comm:
            return "Ray: " + name.replace(".py", "")
    if "ray::" in cmd or "default_worker" in cmd:
        return "Ray: idle workers"
    if "py-spy" in cmd:
        return "py-spy"
    return "other processes of this run"


class Sampler:
    """Snapshots of /proc every `every_s` seconds, on a thread."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.own_cpu_s = 0.0  # what the snapshots cost (in the driver's figure: subtract it)
        self.samples: list[tuple[float, dict[int, tuple[str, float, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.thread_time()
            self.samples.append((time.time(), proc_snapshot()))
            self.own_cpu_s += time.thread_time() - t0
            self._stop.wait(self.every_s)

    def cpu_between(self, t0: float, t1: float) -> tuple[dict[str, float], dict[str, set[int]], float]:
        """CPU seconds per group from the last snapshot at or before t0 to the first at or after t1."""
        before = max((s for s in self.samples if s[0] <= t0), key=lambda s: s[0], default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= t1), key=lambda s: s[0], default=self.samples[-1])
        use: dict[str, float] = defaultdict(float)
        nice: dict[str, set[int]] = defaultdict(set)
        for pid, (group, cpu, n) in after[1].items():
            start = before[1].get(pid)
            used = cpu - (start[1] if start is not None else 0.0)
            if used > 0:
                use[group] += used
                nice[group].add(n)
        return dict(use), dict(nice), after[0] - before[0]


# ------------------------------------------------------------------------------------------ py-spy
def spy(py_spy: str, pids: list[int], seconds: float, out_dir: Path, rate: int) -> list[subprocess.Popen]:
    procs = []
    for pid in pids:
        cmd = [py_spy, "record", "--pid", str(pid), "--rate", str(rate), "--duration", str(int(math.ceil(seconds)))]
        cmd += ["--idle", "--threads", "--nonblocking", "--format", "raw", "-o", str(out_dir / f"{pid}.txt")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def frame_parts(frame: str) -> tuple[str, str]:
    """py-spy's "function (path/file.py:line)" as (function, path)."""
    func, _, rest = frame.partition(" (")
    return func, rest.rsplit(":", 1)[0]


def phase_of(stack: list[str]) -> str:
    for frame in reversed(stack):
        func, path = frame_parts(frame)
        for phase, keys in PHASES:
            if any((func == f or func.endswith("." + f)) and where in path for f, where in keys):
                return phase
    return BETWEEN


def read_profile(path: Path) -> tuple[Counter[str], int]:
    """Samples per phase of the main thread, and the prefetch thread's busy samples (a sample whose
    innermost frame is its loop is the thread blocked in its queue: idle)."""
    phases: Counter[str] = Counter()
    prefetch = 0
    for line in path.read_text().splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            continue
        stack = stack_text.split(";")
        n = int(count)
        if "distrain-prefetch" in stack[0] or any(
            frame_parts(f)[0] == "_loop" and "trainers/task.py" in f for f in stack
        ):
            if not (frame_parts(stack[-1])[0] == "_loop" or frame_parts(stack[-1])[0] in ("wait", "get")):
                prefetch += n
            continue
        if "MainThread" in stack[0]:  # py-spy --threads: "thread (PID): NAME" first
            phases[phase_of(stack[1:])] += n
    return phases, prefetch


# ------------------------------------------------------------------------------------------ contenders
def wait_for_pids(n: int, timeout: float = 120.0) -> list[int]:
    """The training ranks among this process's descendants, once there are `n` of them."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [pid for pid, (group, _, _) in proc_snapshot().items() if group == "training ranks"]
        if len(found) >= n:
            return found[:n]
        time.sleep(0.05)
    return []


def run_ddp(a: argparse.Namespace, tmp: Path, sampler: Sampler) -> dict[str, Any]:
    prefix = tmp / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.workers)]
    cmd += [str(WORKER), "--out", str(prefix), "--model", a.model, "--dataset", a.dataset]
    cmd += ["--global-batch", str(a.global_batch), "--steps", str(a.steps), "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=BENCH_DIR.parent, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    spies = []
    if a.py_spy:
        pids = wait_for_pids(a.workers)
        time.sleep(a.spy_delay)
        spies = spy(a.py_spy, pids, a.spy_seconds, tmp / "spy-ddp", a.rate)
    proc.wait()
    for s in spies:
        s.wait()
    results = [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(a.workers)]
    n = min(len(r["step_end"]) for r in results)
    ends = [max(r["step_end"][k] for r in results) for k in range(n)]
    return {"ends": ends, "spy": tmp / "spy-ddp"}


def run_distrain(a: argparse.Namespace, tmp: Path, sampler: Sampler) -> dict[str, Any]:
    import pandas as pd
    from bsp_throughput import distrain_config  # (benchmarks/ is on the path: this script's own folder)

    from distrain.orchestrator.run import run_training

    config = distrain_config(
        a.workers, a.model, a.dataset, a.global_batch, a.steps, tmp / "distrain", lr=0.05, momentum=0.9, seed=0,
        prefetch=not a.no_prefetch,
    )  # fmt: skip
    spies: list[subprocess.Popen] = []
    if a.py_spy:

        def attach() -> None:
            pids = wait_for_pids(a.workers)
            while pids and not all(b"run_segment" in Path(f"/proc/{p}/cmdline").read_bytes() for p in pids):
                time.sleep(0.05)  # Ray names the method a worker runs in its title: training has begun
            time.sleep(a.spy_delay)
            spies.extend(spy(a.py_spy, pids, a.spy_seconds, tmp / "spy-distrain", a.rate))

        threading.Thread(target=attach, daemon=True).start()
    result = run_training(config)
    time.sleep(a.spy_seconds if spies and any(s.poll() is None for s in spies) else 0)
    for s in spies:
        s.wait()
    df = pd.read_parquet(tmp / "distrain" / "metrics.parquet")
    steps = df[df["kind"] == "step"]
    per_step = steps.groupby("step").agg(end=("wall_time", "max")).sort_index()
    ends = [result.summary["started_at"] + e for e in per_step["end"].tolist()]
    skip = max(1, int(len(ends) * 0.1))
    window = steps[steps["step"] >= skip]
    split = {k: 1e3 * float(window.groupby("worker")[k].median().max()) for k in ("compute_s", "comm_s", "h2d_s")}
    return {"ends": ends, "split": split, "spy": tmp / "spy-distrain"}


def report(name: str, out: dict[str, Any], sampler: Sampler, a: argparse.Namespace) -> None:
    ends = out["ends"]
    skip = max(1, int(len(ends) * 0.1))
    gaps = [b - a_ for a_, b in zip(ends[skip - 1 : -1], ends[skip:], strict=True)]
    steps = len(gaps)
    t0, t1 = ends[skip - 1], ends[-1]
    print(
        f"\n## {name}: {steps} steps in the window, {1e3 * (t1 - t0) / steps:.2f} ms a step (mean), "
        f"median gap {1e3 * statistics.median(gaps):.2f} ms"
    )
    if "split" in out:
        s = out["split"]
        print(
            f"   step rows (median, slowest worker): compute_s {s['compute_s']:.2f} ms, comm_s {s['comm_s']:.2f} ms, "
            f"h2d_s {s['h2d_s']:.3f} ms; the rest of the median gap: "
            f"{1e3 * statistics.median(gaps) - s['compute_s'] - s['comm_s']:.2f} ms"
        )
    use, nice, span = sampler.cpu_between(t0, t1)
    snapshots = sum(1 for t, _ in sampler.samples if t0 <= t <= t1) * sampler.own_cpu_s / len(sampler.samples)
    if "driver (this process)" in use:  # the snapshots themselves, as an estimate
        use["driver (this process)"] -= snapshots
    print(f"   CPU over the window ({span:.2f} s sampled), ms per step and cores busy:")
    for group, cpu in sorted(use.items(), key=lambda kv: -kv[1]):
        print(f"     {group:32s} {1e3 * cpu / steps:7.2f} ms/step  {cpu / span:5.2f} cores  nice {sorted(nice[group])}")
    spy_dir = out["spy"]
    if spy_dir.exists():
        total: Counter[str] = Counter()
        prefetch = 0
        files = sorted(spy_dir.glob("*.txt"))
        for f in files:
            phases, pre = read_profile(f)
            total.update(phases)
            prefetch += pre
        samples = sum(total.values())
        if samples:
            per_rank = samples / len(files)
            ms_per_sample = 1e3 * a.spy_seconds / per_rank  # each sample stands for this much of a rank's time
            step_ms = 1e3 * (t1 - t0) / steps
            print(
                f"   py-spy ({len(files)} ranks, {a.rate} Hz, {per_rank:.0f} samples a rank), ms per step "
                f"(share of the rank's time x {step_ms:.2f} ms):"
            )
            for phase, n in total.most_common():
                share = n / samples
                print(f"     {phase:44s} {share * step_ms:6.2f} ms  ({share:5.1%})")
            print(
                f"     prefetch thread busy: {prefetch / samples * step_ms:.2f} ms a step "
                f"({ms_per_sample:.1f} ms per sample)"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--contenders", default="torchrun,distrain")
    p.add_argument("--no-prefetch", action="store_true", help="distrain reads each batch on its training thread")
    p.add_argument("--py-spy", default="", help="path of a py-spy binary: profile the training ranks")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--spy-delay", type=float, default=1.0, help="seconds after the ranks appear before profiling")
    p.add_argument("--spy-seconds", type=float, default=4.0)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bsp_step_profile-"))
    (tmp / "spy-ddp").mkdir()
    (tmp / "spy-distrain").mkdir()
    print(f"# {' '.join(sys.argv)}\n# load average {os.getloadavg()}; temp dir {tmp}")
    with Sampler() as sampler:
        for name in a.contenders.split(","):
            if name == "torchrun":
                report("torchrun DDP", run_ddp(a, tmp, sampler), sampler, a)
            else:
                import ray

                ray.init(
                    address="local",
                    num_cpus=4,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                )
                time.sleep(5)
                try:
                    report("distrain BSP", run_distrain(a, tmp, sampler), sampler, a)
                finally:
                    ray.shutdown()
    print(f"# load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
