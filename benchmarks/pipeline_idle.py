"""Where a pipeline's idle time goes (issue 32): the bubble, hand-offs between stages, and the cores.

Runs benchmarks/pipeline.py's model (WideMLP, 4 blocks of Linear(1024, 1024), batch 256, Adam, GPipe) at
each S x M asked, and reads the stages' own records: every step row's idle fraction (1 - compute / step),
its compute's CPU time (`pipe_compute_cpu_s`: the wall time of a forward or backward less the time the
stage waited for a core inside it), and the timed forward/backward spans of steps 1-3 (`pipe_spans`).
From the spans, per configuration:

- hand-off: for every micro-batch a stage received (an activation from the stage before, a gradient from
  the stage after), the time from the later of (the sender's compute end, this stage's previous compute
  end) to this stage's compute start: the send, the receive and the wake-up. Median per hand-off (ms),
  and summed per stage and step as a fraction of the step ("hand-off share");
- replay: the same schedule replayed with the measured span durations and free hand-offs: the idle the
  stages would have had with these compute times and zero hand-off latency;
- own cores: the replay again with each span shrunk by its stage's CPU share (a stage alone on a core):
  an estimate of the idle on a machine with a core per stage, hand-offs still free;
- these cores: those CPU seconds replayed on this machine's cores, shared equally among the stages ready
  to run (the kernel's fair share), hand-offs free: the idle that oversubscription alone would give.
  Measured idle less this is what hand-offs and everything else (Python between spans, other processes)
  add;
- cores busy: the stages' compute CPU seconds per step over (cores x step): 1.0 means the stages'
  compute alone fills every core, and no schedule could idle less than 1 - cores / S;
- run queue (`pipe_runq_s`, Linux's run delay of the stage's thread): the share of the step a stage was
  ready but waited for a core, split into the part inside its compute (the compute's wall time less its
  CPU time) and the part in its idle time (woken, e.g. by a micro-batch's arrival, and no core free):
  "idle waiting for a core" is that second part as a share of the step, the oversubscription inside
  the idle fraction.

    python benchmarks/pipeline_idle.py [--configs 4x8 2x8] [--steps 8] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training
from distrain.strategies.pipeline import bubble_fraction

TASK = str(Path(__file__).resolve().parent.parent / "tests" / "pipeline_task.py") + ":WideMLP"
BATCH = 256

Spans = dict[tuple[str, int, int], tuple[float, float]]  # (kind, stage, micro-batch) -> (start, end)


def handoffs(spans: Spans, stages: int, micro: int) -> list[tuple[int, float, bool]]:
    """(receiving stage, seconds, whether the stage waited for it) per received micro-batch."""
    out = []
    for s in range(stages):
        for m in range(micro):
            if s > 0:  # the activation from stage s - 1
                before = spans[("F", s, m - 1)][1] if m > 0 else None
                out.append(_handoff(spans, ("F", s - 1, m), ("F", s, m), before, s))
            if s < stages - 1:  # the gradient from stage s + 1
                before = spans[("B", s, m - 1)][1] if m > 0 else spans[("F", s, micro - 1)][1]
                out.append(_handoff(spans, ("B", s + 1, m), ("B", s, m), before, s))
    return out


def _handoff(spans: Spans, sender: tuple, receiver: tuple, before: float | None, stage: int) -> tuple[int, float, bool]:
    sent = spans[sender][1]
    ready = sent if before is None else max(sent, before)
    return stage, max(0.0, spans[receiver][0] - ready), before is None or sent >= before


def replay(durations: dict[tuple[str, int, int], float], stages: int, micro: int) -> list[float]:
    """GPipe with these span durations and free hand-offs: each stage's idle fraction of the step."""
    end: dict[tuple[str, int, int], float] = {}
    for s in range(stages):
        for m in range(micro):
            start = max(end.get(("F", s - 1, m), 0.0), end.get(("F", s, m - 1), 0.0))
            end[("F", s, m)] = start + durations[("F", s, m)]
    for s in reversed(range(stages)):
        for m in range(micro):
            prev = end[("B", s, m - 1)] if m > 0 else end[("F", s, micro - 1)]
            start = max(prev, end.get(("B", s + 1, m), 0.0))
            end[("B", s, m)] = start + durations[("B", s, m)]
    step = end[("B", 0, micro - 1)]
    busy = [sum(d for (k, st, _), d in durations.items() if st == s) for s in range(stages)]
    return [1.0 - b / step for b in busy]


def replay_on_cores(work: dict[tuple[str, int, int], float], stages: int, micro: int, cores: int) -> list[float]:
    """GPipe with these CPU seconds per span on `cores` shared cores (the runnable stages share them
    equally, as the kernel's fair scheduler does) and free hand-offs: each stage's idle fraction, counted as
    the stages count it (1 - the wall time of its spans / the step)."""
    order = [[("F", s, m) for m in range(micro)] + [("B", s, m) for m in range(micro)] for s in range(stages)]
    at = [0] * stages  # index of each stage's current span
    left = {k: v for k, v in work.items()}
    began: dict[tuple[str, int, int], float] = {}
    ended: dict[tuple[str, int, int], float] = {}
    now = 0.0

    def ready(s: int) -> bool:
        if at[s] >= len(order[s]):
            return False
        kind, _, m = order[s][at[s]]
        before = ("F", s - 1, m) if kind == "F" else ("B", s + 1, m)
        return (kind == "F" and s == 0) or (kind == "B" and s == stages - 1) or before in ended

    while any(a < len(o) for a, o in zip(at, order, strict=True)):
        running = [s for s in range(stages) if ready(s)]
        rate = min(1.0, cores / len(running))
        for s in running:
            began.setdefault(order[s][at[s]], now)
        dt = min(left[order[s][at[s]]] for s in running) / rate
        now += dt
        for s in running:
            key = order[s][at[s]]
            left[key] -= dt * rate
            if left[key] <= 1e-12:
                ended[key] = now
                at[s] += 1
    busy = [sum(ended[k] - began[k] for k in ended if k[1] == s) for s in range(stages)]
    return [1.0 - b / now for b in busy]


def run(root: Path, stages: int, micro: int, steps: int, tag: str) -> dict[str, Any]:
    config = RunConfig(
        task=TASK, task_args={"blocks": 4, "samples": BATCH * (steps + 1) + 64}, optimizer="adam", lr=1e-4,
        workers=1, batch_size=BATCH, epochs=1, max_steps=steps, segment_steps=steps, eval_every=0,
        run_dir=str(root / tag), pipeline_stages=stages, microbatches=micro, pipeline_schedule="gpipe",
    )  # fmt: skip
    df = pd.read_parquet(run_training(config).run_dir / "metrics.parquet")
    rows = df[(df["kind"] == "step") & (df["step"] >= 2)]
    out: dict[str, Any] = {"S": stages, "M": micro, "formula": bubble_fraction(stages, micro)}
    idle = rows.groupby("stage")["pipe_idle_frac"].median()
    out["idle min"], out["idle max"], out["idle mean"] = idle.min(), idle.max(), idle.mean()
    if "pipe_compute_cpu_s" in rows:
        share = (rows["pipe_compute_cpu_s"] / rows["pipe_compute_s"]).median()
        out["CPU share of compute"] = share
        per_step = rows.groupby("step").agg(cpu=("pipe_compute_cpu_s", "sum"), step_s=("pipe_step_s", "median"))
        out["cores busy"] = float((per_step["cpu"] / (os.cpu_count() or 1) / per_step["step_s"]).median())
    if "pipe_runq_s" in rows and rows["pipe_runq_s"].notna().all():
        in_compute = rows["pipe_compute_s"] - rows["pipe_compute_cpu_s"]
        out["idle waiting for a core"] = float(((rows["pipe_runq_s"] - in_compute) / rows["pipe_step_s"]).median())
        out["compute waiting for a core"] = float((in_compute / rows["pipe_step_s"]).median())
    spanned = df[(df["kind"] == "step") & df["pipe_spans"].notna()]
    lat, waited_share, replays, own, shared = [], [], [], [], []
    for _step, group in spanned.groupby("step"):
        if len(group) < stages:
            continue
        spans: Spans = {}
        cpu_share: dict[int, float] = {}
        for _, row in group.iterrows():
            for kind, mb, t0, t1 in json.loads(row["pipe_spans"]):
                spans[(kind, int(row["stage"]), int(mb))] = (t0, t1)
            if "pipe_compute_cpu_s" in row and pd.notna(row["pipe_compute_cpu_s"]):
                cpu_share[int(row["stage"])] = row["pipe_compute_cpu_s"] / row["pipe_compute_s"]
        hand = handoffs(spans, stages, micro)
        lat += [h for _, h, waited in hand if waited]
        step_s = float(group["pipe_step_s"].median())
        for s in range(stages):
            waited_share.append(sum(h for st, h, _ in hand if st == s) / step_s)
        durations = {k: t1 - t0 for k, (t0, t1) in spans.items()}
        replays.append(statistics.mean(replay(durations, stages, micro)))
        if cpu_share:
            alone = {k: d * cpu_share[k[1]] for k, d in durations.items()}  # each span's CPU seconds
            own.append(statistics.mean(replay(alone, stages, micro)))
            shared.append(statistics.mean(replay_on_cores(alone, stages, micro, os.cpu_count() or 1)))
    out["hand-off ms (median)"] = 1e3 * statistics.median(lat) if lat else float("nan")
    out["hand-off share"] = statistics.mean(waited_share) if waited_share else float("nan")
    out["replay idle"] = statistics.median(replays) if replays else float("nan")
    out["own-core idle"] = statistics.median(own) if own else float("nan")
    out["these-cores idle"] = statistics.median(shared) if shared else float("nan")
    out["step ms"] = 1e3 * float(rows.groupby("step")["pipe_step_s"].median().median())
    out["load"] = os.getloadavg()[0]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["4x8", "2x8"], help="S x M, e.g. 4x8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    start_local_ray(num_cpus=8)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            for text in args.configs:
                s, m = (int(v) for v in text.split("x"))
                results.append(run(Path(tmp), s, m, args.steps, f"r{r}s{s}m{m}"))
                print(json.dumps(results[-1]), flush=True)
    columns = list(results[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in results:
        print("| " + " | ".join(f"{row.get(c, float('nan')):.3g}" for c in columns) + " |")


if __name__ == "__main__":
    main()
