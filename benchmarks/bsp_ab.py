"""A/B of distrain trees against torchrun DDP: `bsp_throughput.py` once per contender, interleaved.

    .venv/bin/python benchmarks/bsp_ab.py --tree main=/path/with/distrain-link --tree new=/other/path \\
        [--rounds 5] [-- <bsp_throughput.py arguments, e.g. --model resnet18 --steps 40>]

Each round runs torchrun DDP once and distrain BSP once per tree, each as its own
`bsp_throughput.py --rounds 1 --contenders ...` process (with PYTHONPATH set to the tree's directory, whose
`distrain` entry is the tree, and that tree's copy of the script), in an order that rotates every round,
so machine load drifts over all of them alike. Prints every run's samples/s and step time, each round's
ratios (tree / DDP, tree / first tree) and their medians, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(name: str, tree: str, script: Path, extra: list[str], raw: Path) -> dict:
    contender = "torchrun" if name == "ddp" else "distrain"
    cmd = [sys.executable, str(script), "--rounds", "1", "--contenders", contender, "--raw", str(raw), *extra]
    pythonpath, *settings = tree.split(",")  # DIR[,VAR=VALUE...]: environment variables for this tree's runs
    env = dict(os.environ, PYTHONPATH=pythonpath) | dict(kv.split("=", 1) for kv in settings)
    proc = subprocess.run(cmd, env=env, cwd=script.parent.parent, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stdout[-2000:] + proc.stderr[-2000:]}
    m = json.loads(raw.read_text())[0]
    return {"sps": m["samples_per_s"], "step_ms": m["extra"].get("step_ms_median")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tree", action="append", required=True, help="NAME=DIR[,VAR=VALUE...] (DIR/distrain is the tree)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("extra", nargs="*", help="arguments for bsp_throughput.py (after --)")
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    contenders = ["ddp", *trees]
    tmp = Path(tempfile.mkdtemp(prefix="bsp_ab-"))
    print(f"# {' '.join(sys.argv)}\n# load average before: {os.getloadavg()}", flush=True)
    results: dict[str, list[dict]] = {c: [] for c in contenders}
    first = next(iter(trees))
    for rnd in range(a.rounds):
        k = rnd % len(contenders)
        order = contenders[k:] + contenders[:k]
        if rnd % 2:
            order.reverse()
        for name in order:
            tree = trees.get(name, trees[first])
            script = Path(tree.split(",")[0]) / "distrain" / "benchmarks" / "bsp_throughput.py"
            r = run(name, tree, script, a.extra, tmp / f"{name}-{rnd}.json")
            results[name].append(r)
            print(f"[round {rnd + 1}] {name}: {r}", flush=True)
        row = {name: results[name][-1].get("sps") for name in contenders}
        if all(row.values()):
            ratios = ", ".join(f"{t}/ddp {row[t] / row['ddp']:.3f}" for t in trees)
            ratios += "".join(f", {t}/{first} {row[t] / row[first]:.3f}" for t in trees if t != first)
            print(f"[round {rnd + 1}] {ratios}  (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"\n# load average after: {os.getloadavg()}")
    ok = {c: [r for r in rs if "sps" in r] for c, rs in results.items()}
    for c, rs in ok.items():
        if rs:
            runs = ", ".join(format(r["sps"], ",.0f") for r in rs)
            print(
                f"{c:10s} samples/s median {statistics.median(r['sps'] for r in rs):,.0f} "
                f"(runs {runs}); step ms median "
                f"{statistics.median(r['step_ms'] for r in rs):.2f}"
            )
    paired = [
        {c: results[c][i]["sps"] for c in contenders}
        for i in range(a.rounds)
        if all("sps" in results[c][i] for c in contenders)
    ]
    for t in trees:
        per = [row[t] / row["ddp"] for row in paired]
        if per:
            print(f"{t}/ddp per round: {', '.join(f'{x:.3f}' for x in per)}; median {statistics.median(per):.3f}")
        if t != first and paired:
            per = [row[t] / row[first] for row in paired]
            print(f"{t}/{first} per round: {', '.join(f'{x:.3f}' for x in per)}; median {statistics.median(per):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
