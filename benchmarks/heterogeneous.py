"""Heterogeneous workers, side by side in one invocation (issue 31).

Two cases, every run of both interleaved round by round on one Ray started once:

1. A fast and a slow worker: worker 1 of 2 computes 3x slower (`--straggler 1:x3`, its compute
   stretched, so a smaller share is faster). Four contenders at the same global batch 2B and the same
   two actors:
   - plain BSP (collective), equal shares: every step waits for the slow worker;
   - backup workers (`--transport ps --workers 1 --backup-workers 1 --batch-size 2B`): each round applies
     the first gradient in, so the slow worker's are mostly dropped;
   - static shares (`--worker-weights 3,1`): b = 1.5B and 0.5B, the speeds known in advance;
   - speed-balanced BSP (`--balance speed`): the driver measures and moves the shares.
2. A static "fast" and "slow" resource group: workers 0-1 fast, 2-3 at `--straggler x3`, global batch
   4B; plain BSP, the groups' known speeds as per-group batch sizes (`--worker-group fast:2:1.5B
   --worker-group slow:2:0.5B`, on one node here: placement by node kind is tests/integration/
   test_worker_groups.py's), and `--balance speed`.

Reported per contender: `steady_state_samples_per_s` (summary.json) and its ratio to its case's plain
BSP, and the training time to a validation accuracy (from the first step, one evaluation per epoch;
benchmarks/stragglers.py's `training_time_to_target`), medians over the rounds. Acceptance (issue 31):
speed-balanced >= 1.4x plain BSP's samples/s, and its time to target not behind backup workers'.

    python benchmarks/heterogeneous.py [--rounds 2] [--epochs 10] [--batch-size 32] [--target 0.95]
        [--model cnn] [--cases pair,groups] [--out FILE]

Smallest (a smoke run, not figures): --rounds 1 --epochs 2 --model mlp --target 0.8. Run it on a quiet
machine: every contender's speed is its slowest worker's, so load from other processes moves the
figures more than the contenders differ.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from stragglers import training_time_to_target  # this folder is sys.path[0] when run as a script

from distrain.config import RunConfig
from distrain.orchestrator.cluster import start_local_ray
from distrain.orchestrator.run import run_training

PLAIN = "plain BSP"
BACKUP = "backup workers (ps, 1 + 1 backup)"
BALANCED = "speed-balanced"
CASES = {
    "pair": "1 fast + 1 slow worker (--straggler 1:x3)",
    "groups": "static groups: 2 fast + 2 slow workers (--straggler 2:x3 3:x3)",
}


def contenders(case: str, b: int) -> dict[str, dict]:
    """Each contender's RunConfig fields for `case`, plain BSP first (the ratios' reference)."""
    if case == "pair":
        slow = dict(straggler=["1:x3"])
        return {
            PLAIN: dict(workers=2, batch_size=b, **slow),
            BACKUP: dict(transport="ps", workers=1, backup_workers=1, batch_size=2 * b, **slow),
            "static shares 3,1": dict(workers=2, batch_size=b, worker_weights="3,1", **slow),
            BALANCED: dict(workers=2, batch_size=b, balance="speed", **slow),
        }
    slow = dict(workers=4, batch_size=b, straggler=["2:x3", "3:x3"])
    return {
        PLAIN: slow,
        # --worker-group: two groups at 1.5B and 0.5B per worker (ranks dealt group by group: 2-3 are slow)
        "resource groups fast:2, slow:2": dict(
            worker_groups=[f"fast:2:{3 * b // 2}", f"slow:2:{b // 2}"], straggler=slow["straggler"]
        ),
        BALANCED: dict(balance="speed", **slow),
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--out", type=Path, default=None, help="also append the markdown tables to this file")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        ap.error(f"--cases takes a comma-separated list of: {', '.join(CASES)}")

    start_local_ray(8)
    scratch = Path(tempfile.mkdtemp(prefix="distrain-heterogeneous-"))
    rates: dict[tuple[str, str], list[float]] = {}
    times: dict[tuple[str, str], list[float]] = {}
    shares: dict[tuple[str, str], list[int]] = {}
    t_all = time.perf_counter()
    n = 0
    for r in range(args.rounds):
        for case in cases:
            for name, kw in contenders(case, args.batch_size).items():
                n += 1
                config = RunConfig(
                    model=args.model, epochs=args.epochs, target_accuracy=args.target, seed=r, segment_steps=10,
                    run_dir=str(scratch / f"run{n}"), **kw,
                )  # fmt: skip
                t0 = time.perf_counter()
                run = run_training(config)
                rate = run.summary.get("steady_state_samples_per_s")
                t, _ = training_time_to_target(run.run_dir, args.target)
                key = (case, name)
                shares[key] = run.summary.get("worker_shares", [])
                print(
                    f"round {r + 1}: {case:<6} {name:<34} {rate} samples/s, to {args.target}: {t} s, "
                    f"shares {shares[key]}, run {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
                if rate:
                    rates.setdefault(key, []).append(rate)
                if t is not None:
                    times.setdefault(key, []).append(t)
    total = time.perf_counter() - t_all

    lines = [
        f"Global batch {args.batch_size} per worker; model {args.model}, up to {args.epochs} epochs; target "
        f"validation accuracy {args.target}; median of {args.rounds} round(s); {total:.0f} s in all.",
    ]
    for case in cases:
        plain = median(rates.get((case, PLAIN), []))
        lines += [
            "",
            f"**{CASES[case]}**",
            "",
            "| contender | steady-state samples/s | vs plain BSP | time to target (s) | shares at the end |",
            "|---|---|---|---|---|",
        ]
        for name in contenders(case, args.batch_size):
            rate, t = median(rates.get((case, name), [])), median(times.get((case, name), []))
            ratio = f"{rate / plain:.2f}x" if rate and plain else "-"
            lines.append(
                f"| {name} | {'-' if rate is None else f'{rate:,.0f}'} | {ratio} | "
                f"{'not reached' if t is None else f'{t:.1f}'} | {'/'.join(map(str, shares[(case, name)])) or '-'} |"
            )
    if "pair" in cases:  # issue 31's acceptance, on the pair
        plain, balanced = median(rates.get(("pair", PLAIN), [])), median(rates.get(("pair", BALANCED), []))
        t_bal, t_backup = median(times.get(("pair", BALANCED), [])), median(times.get(("pair", BACKUP), []))
        speedup = balanced / plain if balanced and plain else None
        lines += [
            "",
            f"Acceptance: speed-balanced / plain BSP samples/s = {'-' if speedup is None else f'{speedup:.2f}x'} "
            f"(>= 1.4x: {'yes' if speedup and speedup >= 1.4 else 'no'}); time to target "
            f"{'-' if t_bal is None else f'{t_bal:.1f} s'} vs backup workers' "
            f"{'-' if t_backup is None else f'{t_backup:.1f} s'} (not behind: "
            f"{'yes' if t_bal is not None and (t_backup is None or t_bal <= t_backup) else 'no'}).",
        ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
