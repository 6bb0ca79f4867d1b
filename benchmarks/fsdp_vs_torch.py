"""--fsdp against a plain torchrun + FSDP2 script (benchmarks/_fsdp_plain.py) doing the same steps: the
char LM example's transformer, D = 4 workers, AdamW, each worker its own slice of a global batch of
4 x B windows. Tokens/s of the steps after the warm-up, interleaved (plain, distrain, plain, ...) on
this machine, and distrain's share of the peer's.

distrain's figure is its summary's steady-state samples/s x the window length (the steps after the
first 10 %, evaluation off); the plain script's, the same steps after its first 10 %.

    python benchmarks/fsdp_vs_torch.py [--rounds 2] [--shards 4] [--dim 128] [--layers 2] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

HERE = Path(__file__).resolve().parent
SEQ_LEN = 64


def plain(args: argparse.Namespace) -> float:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", f"--nproc-per-node={args.shards}", str(HERE / "_fsdp_plain.py")]
    command += ["--dim", str(args.dim), "--layers", str(args.layers), "--batch-size", str(args.batch_size)]
    command += ["--steps", str(args.steps), "--seq-len", str(SEQ_LEN)]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=True,
        env={"OMP_NUM_THREADS": "1"} | dict(__import__("os").environ),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def distrain_run(args: argparse.Namespace, run_dir: str) -> float:
    config = RunConfig(
        task=f"{HERE.parent / 'examples' / 'char_lm.py'}:CharLM",
        task_args={"dim": args.dim, "layers": args.layers, "seq_len": SEQ_LEN},
        optimizer="adamw", lr=1e-3, workers=1, fsdp=args.shards, batch_size=args.batch_size, epochs=1,
        max_steps=args.steps, segment_steps=10, eval_every=0, run_dir=run_dir, prefetch=args.prefetch,
    )  # fmt: skip
    result = run_training(config)
    assert result.summary["status"] == "completed", result.summary["status"]
    return result.summary["steady_state_samples_per_s"] * SEQ_LEN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("rounds", 2), ("shards", 4), ("dim", 128), ("layers", 2), ("batch-size", 16), ("steps", 40)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    start_local_ray(num_cpus=max(4, args.shards))
    rates: dict[str, list[float]] = {"plain": [], "distrain": []}
    with tempfile.TemporaryDirectory() as root:
        for r in range(args.rounds):
            rates["plain"].append(plain(args))
            rates["distrain"].append(distrain_run(args, f"{root}/run{r}"))
            print(f"round {r + 1}: plain {rates['plain'][-1]:,.0f} tokens/s, distrain {rates['distrain'][-1]:,.0f}")
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"median: plain {med['plain']:,.0f} tokens/s, distrain {med['distrain']:,.0f} tokens/s, "
          f"distrain / plain = {med['distrain'] / med['plain']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
