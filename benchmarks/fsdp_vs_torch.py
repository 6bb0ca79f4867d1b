"""--fsdp against a plain torchrun + FSDP2 script (benchmarks/_fsdp_plain.py) doing the same steps: the
char LM example's transformer, D = 4 workers, AdamW, each worker its own slice of a global batch of
4 x B windows. Tokens/s of the steps after the warm-up, interleaved (plain, distrain, plain, ...) on
this machine, and distrain's share of the peer's.

distrain's figure is its summary's steady-state samples/s x the window length (the steps after the
first 10 %, evaluation off); the plain script's, the same steps after its first 10 %.

With `--checkpoint-steps K` both save a checkpoint after every K-th step but the last: distrain its
sharded asynchronous checkpoints (each save's blocking seconds: the most any worker's row records for
that step), the plain script a bare `dcp.async_save` of the same model and optimizer state (the most
any rank was blocked), and the medians are compared.

    python benchmarks/fsdp_vs_torch.py [--rounds 2] [--shards 4] [--dim 128] [--layers 2] [--steps 40]
        [--checkpoint-steps 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

HERE = Path(__file__).resolve().parent
SEQ_LEN = 64


def plain(args: argparse.Namespace, root: str) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", f"--nproc-per-node={args.shards}", str(HERE / "_fsdp_plain.py")]
    command += ["--dim", str(args.dim), "--layers", str(args.layers), "--batch-size", str(args.batch_size)]
    command += ["--steps", str(args.steps), "--seq-len", str(SEQ_LEN)]
    command += ["--checkpoint-steps", str(args.checkpoint_steps), "--checkpoint-dir", root]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1"} | dict(__import__("os").environ),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def distrain_run(args: argparse.Namespace, run_dir: str) -> dict:
    config = RunConfig(
        task=f"{HERE.parent / 'examples' / 'char_lm.py'}:CharLM",
        task_args={"dim": args.dim, "layers": args.layers, "seq_len": SEQ_LEN},
        optimizer="adamw", lr=1e-3, workers=1, fsdp=args.shards, batch_size=args.batch_size, epochs=1,
        max_steps=args.steps, segment_steps=10, eval_every=0, run_dir=run_dir, prefetch=args.prefetch,
        checkpoint_steps=args.checkpoint_steps,
    )  # fmt: skip
    result = run_training(config)
    assert result.summary["status"] == "completed", result.summary["status"]
    rows = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    saves = rows[(rows["kind"] == "step") & (rows["step"] + 1 < args.steps)].dropna(subset=["ckpt_block_s"])
    blocked = saves.groupby("step")["ckpt_block_s"].max().tolist()
    return {"tokens_per_s": result.summary["steady_state_samples_per_s"] * SEQ_LEN, "save_block_s": blocked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rounds", 2), ("shards", 4), ("dim", 128), ("layers", 2), ("batch-size", 16), ("steps", 40)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpoint-steps", type=int, default=0)
    args = parser.parse_args()
    start_local_ray(num_cpus=max(4, args.shards))
    rates: dict[str, list[float]] = {"plain": [], "distrain": []}
    blocked: dict[str, list[float]] = {"plain": [], "distrain": []}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            for name, got in (
                ("plain", plain(args, f"{root}/plain{r}")),
                ("distrain", distrain_run(args, f"{root}/run{r}")),
            ):
                rates[name].append(got["tokens_per_s"])
                blocked[name] += got["save_block_s"]
            print(f"round {r + 1}: plain {rates['plain'][-1]:,.0f} tokens/s, distrain {rates['distrain'][-1]:,.0f}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"median: plain {med['plain']:,.0f} tokens/s, distrain {med['distrain']:,.0f} tokens/s, "
          f"distrain / plain = {med['distrain'] / med['plain']:.2f}")  # fmt: skip
    if args.checkpoint_steps:
        saves = {k: statistics.median(v) for k, v in blocked.items()}
        print(
            f"checkpoint blocking per save, median of {len(blocked['plain'])} and {len(blocked['distrain'])}: "
            f"bare dcp.async_save {saves['plain'] * 1e3:.1f} ms, distrain {saves['distrain'] * 1e3:.1f} ms "
            f"(max {max(blocked['distrain']) * 1e3:.1f} ms), distrain / bare = {saves['distrain'] / saves['plain']:.2f}"
        )


if __name__ == "__main__":
    main()
