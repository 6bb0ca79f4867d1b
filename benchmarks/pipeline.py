"""Pipelines (issue 16): throughput, idle fraction and memory per actor for S in {1, 2, 4} stages and
M in {1, 2, 4, 8} micro-batches, against the bubble formula (S - 1)/(M + S - 1).

The model is tests/pipeline_task.py's WideMLP with 4 blocks of Linear(1024, 1024) + tanh (4.2M
parameters, 16.8 MB in float32), one replica (R = 1), a batch of 256 rows, Adam. S = 1 is plain BSP
with one worker (no micro-batching: --microbatches needs a pipeline). Every run trains --steps steps;
the figures are medians over the steps after the first two (shape inference, warm-up).

Per configuration: samples/s (the batch over the median wall time between the last stage's steps), the median idle
fraction of the most idle stage and of the least idle one, the formula's value, and per actor the
bytes of parameters + gradients + optimizer state and the peak of saved activations (stage 0, which
holds the most under both schedules).

    python benchmarks/pipeline.py [--steps 8] [--schedule gpipe] [--stages 1 2 4] [--microbatches 1 2 4 8]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training
from distrain.strategies.pipeline import bubble_fraction

TASK = str(Path(__file__).resolve().parent.parent / "tests" / "pipeline_task.py") + ":WideMLP"
BATCH = 256


def run_one(root: Path, stages: int, microbatches: int, schedule: str, steps: int) -> dict:
    extra = dict(pipeline_stages=stages, microbatches=microbatches, pipeline_schedule=schedule) if stages > 1 else {}
    config = RunConfig(
        task=TASK, task_args={"blocks": 4, "samples": BATCH * (steps + 1) + 64}, optimizer="adam", lr=1e-4,
        workers=1, batch_size=BATCH, epochs=1, max_steps=steps, segment_steps=steps, eval_every=0,
        run_dir=str(root / f"s{stages}m{microbatches}{schedule}"), **extra,
    )  # fmt: skip
    result = run_training(config)
    df = pd.read_parquet(result.run_dir / "metrics.parquet")
    rows = df[(df["kind"] == "step") & (df["step"] >= 2)]
    # Wall time between consecutive steps of the last stage (of the only worker without a pipeline).
    last = rows[rows["samples"] > 0].sort_values("step")
    step_s = last["wall_time"].diff().dropna().median()
    out = {"S": stages, "M": microbatches if stages > 1 else 1, "samples/s": BATCH / step_s}
    out["bubble formula"] = bubble_fraction(stages, microbatches if stages > 1 else 1)
    if stages > 1:
        idle = rows.groupby("stage")["pipe_idle_frac"].median()
        out["idle min"], out["idle max"] = idle.min(), idle.max()
        first = rows[rows["stage"] == 0]
        held = first[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max().sum()
        out["state MB / actor (stage 0)"] = held / 1e6
        out["activations MB (stage 0)"] = first["mem_activation_peak_bytes"].max() / 1e6
    else:
        out["idle min"] = out["idle max"] = 0.0
        params = 4 * (1024 * 1024 + 1024) * 4
        out["state MB / actor (stage 0)"] = 4 * params / 1e6  # parameters, gradients, Adam's two moments
        out["activations MB (stage 0)"] = float("nan")  # not metered without a pipeline
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    start_local_ray(num_cpus=8)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for stages in args.stages:
            for m in args.microbatches if stages > 1 else [1]:
                results.append(run_one(Path(tmp), stages, m, args.schedule, args.steps))
                print(results[-1], flush=True)
    columns = list(results[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print("| " + " | ".join(f"{r.get(c, float('nan')):.3g}" for c in columns) + " |")


if __name__ == "__main__":
    main()
