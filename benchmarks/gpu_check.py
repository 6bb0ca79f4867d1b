"""Issue 29's checks on the lent GPU machine, in one run of a few minutes that records as it goes.

    python benchmarks/gpu_check.py --out DIR [--budget 450] [--only probe,strategies,...] [--epochs 6]

The lent machine (one H100 or H200, 16 cores) has torch but no Ray: carry the Ray wheel and what it
needs (benchmarks/RESULTS.md, "GPU" section, has the command). Sections, most important first; each
appends JSON records to DIR/gpu_check.jsonl the moment it has them, so a run cut off at its time limit
still returns what it measured, and a section that fails records its traceback and the next one runs:

  env         torch, CUDA, the device, nvidia-ml-py
  probe       what the shared-GPU path needs of torch.distributed on CUDA tensors: gloo all-reduce,
              broadcast, point-to-point (pipelines), reduce-scatter and all-gather (FSDP) between two
              processes on the one GPU; NCCL in a group of one, and NCCL's refusal of two ranks on one GPU
  strategies  every strategy trains the default task (cnn on digits) on the GPU; the same runs on the
              CPU at the end (section cpu) give the quality each reaches there
  lm          the char-LM example at a GPU-sized shape: one distrain worker (NCCL group of one) against
              a plain PyTorch loop with the same model, batch, optimizer and precision, in this process,
              side by side (tokens/s); fp32, bf16 and fp16 (speed-up and final loss)
  overflow    fp16 on a loss that overflows the starting scale: the same skipped steps on both replicas
  chaos       --chaos kill-worker under BSP with --deterministic against an unbroken run: test losses
  ddp         BSP with 2 workers sharing the GPU against DDP over gloo with 2 ranks sharing it
  comm        communication-bound: benchmarks/comm_efficient.py's BSP and DiLoCo (CPU workers) at an
              emulated 20 Mbit/s link with 20 ms a transfer: time to BSP's loss after 2 epochs
  lm_algos    the example's default shape under BSP and DiLoCo, 2 workers sharing the GPU
  cpu         the strategies' runs again on the CPU (quality reference)

Not part of the test suite (CI has no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHAR_LM = f"{ROOT / 'examples' / 'char_lm.py'}:CharLM"
# The example at a shape that gives the GPU work (its default, dim 64 and 2 layers, is launch-bound).
LM_GPU_ARGS = {"max_bytes": 2_000_000, "seq_len": 256, "dim": 512, "layers": 6, "heads": 8}
LM_BATCH = 64
LM_STEPS = 120
COMM_BANDWIDTH = "20mbit"
ONLY_STRATEGIES: list[str] = []  # --strategies: these of STRATEGIES only
PRECISIONS = ["fp32", "bf16", "fp16"]
LM_ROUNDS = 1

OUT: Path = Path(".")
# Without a GPU (a dry run on the CPU machine, to check this script before spending device time) every
# section runs on the CPU instead, at the same settings.
DEV = "cpu"
T0 = time.perf_counter()
BUDGET = 450.0


def left() -> float:
    return BUDGET - (time.perf_counter() - T0)


def record(section: str, name: str, **fields) -> None:
    row = {"section": section, "name": name, "t": round(time.perf_counter() - T0, 1), **fields}
    with open(OUT / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
    print(json.dumps(row, default=str), flush=True)


# ------------------------------------------------------------------------------------------------ env


def section_env() -> None:
    import torch

    fields = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        fields |= {"device": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count}
    try:
        import pynvml

        pynvml.nvmlInit()
        fields["nvml_driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as e:  # noqa: BLE001
        fields["nvml"] = repr(e)
    fields["cores"] = os.cpu_count()
    record("env", "machine", **fields)


# ---------------------------------------------------------------------------------------------- probe


def _probe_rank(rank: int, world: int, port: int, backend: str, device: str, queue) -> None:
    import torch
    import torch.distributed as dist

    results: dict[str, str] = {}
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=20)
        )
    except Exception as e:  # noqa: BLE001
        queue.put((rank, {"init": f"{type(e).__name__}: {str(e)[:300]}"}))
        return
    dev = torch.device(device)

    def attempt(name, fn):
        try:
            ok = fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            results[name] = "ok" if ok in (None, True) else f"wrong result: {ok}"
        except Exception as e:  # noqa: BLE001
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

    def all_reduce(group):
        t = torch.full((1 << 16,), float(rank + 1), device=dev)
        dist.all_reduce(t, group=group)
        return bool((t == sum(range(1, world + 1))).all())

    def broadcast(group):
        t = torch.full((1000,), float(rank), device=dev)
        dist.broadcast(t, 0, group=group)
        return bool((t == 0).all())

    def send_recv(group):
        t = torch.arange(1000.0, device=dev) if rank == 0 else torch.zeros(1000, device=dev)
        if rank == 0:
            dist.send(t, 1, group=group)
        else:
            dist.recv(t, 0, group=group)
        return bool((t == torch.arange(1000.0, device=dev)).all())

    def batch_p2p(group):
        t = torch.arange(1000.0, device=dev) if rank == 0 else torch.zeros(1000, device=dev)
        op = dist.P2POp(dist.isend, t, 1, group) if rank == 0 else dist.P2POp(dist.irecv, t, 0, group)
        for w in dist.batch_isend_irecv([op]):
            w.wait()
        return bool((t == torch.arange(1000.0, device=dev)).all())

    def reduce_scatter(group):
        inp = torch.full((world * 512,), float(rank + 1), device=dev)
        out = torch.empty(512, device=dev)
        dist.reduce_scatter_tensor(out, inp, group=group)
        return bool((out == sum(range(1, world + 1))).all())

    def all_gather(group):
        inp = torch.full((512,), float(rank), device=dev)
        out = torch.empty(world * 512, device=dev)
        dist.all_gather_into_tensor(out, inp, group=group)
        return bool((out.view(world, 512)[:, 0] == torch.arange(world, device=dev, dtype=out.dtype)).all())

    # Each operation on a group of its own: a failed one can break its group's connections (gloo closes
    # the pair), and the operations after it would then fail for that reason alone.
    ops = [("all_reduce", all_reduce), ("broadcast", broadcast), ("reduce_scatter_tensor", reduce_scatter),
           ("all_gather_into_tensor", all_gather)]  # fmt: skip
    if world > 1:
        ops += [("send_recv", send_recv), ("batch_isend_irecv", batch_p2p)]
    for name, fn in ops:
        group = dist.new_group(backend=backend) if world > 1 else None
        attempt(name, lambda fn=fn, group=group: fn(group))
    queue.put((rank, results))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _probe(world: int, backend: str) -> dict:
    import torch.multiprocessing as mp

    from distrain.strategies.collective import free_address

    port = int(free_address("127.0.0.1").rsplit(":", 1)[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, world, port, backend, DEV, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.time() + (45 if backend == "gloo" else 30)
    while len(out) < world and time.time() < deadline:
        try:
            rank, res = queue.get(timeout=max(0.1, deadline - time.time()))
            out[rank] = res
        except Exception:  # noqa: BLE001
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return out


def section_probe() -> None:
    for world, backend in ((2, "gloo"), (1, "nccl"), (2, "nccl")) if DEV == "cuda" else ((2, "gloo"),):
        res = _probe(world, backend)
        record("probe", f"{backend} x{world} on one GPU", **{f"rank{r}": v for r, v in sorted(res.items())})


# ------------------------------------------------------------------------------------------ strategies

# name -> fit options (the default task: cnn on digits); actors share the one GPU equally
STRATEGIES: dict[str, dict] = {
    "bsp (NCCL, 1 worker)": {"workers": 1, "batch_size": 64},
    "bsp": {"workers": 2},
    "bsp --transport ps": {"workers": 2, "transport": "ps"},
    "async": {"workers": 2, "strategy": "async"},
    "ssp --staleness 2": {"workers": 2, "strategy": "ssp", "staleness": 2},
    "local-sgd --adaptive-tau": {"workers": 2, "strategy": "local-sgd", "tau": 4, "adaptive_tau": True},
    "diloco --sync-every 8": {"workers": 2, "strategy": "diloco", "sync_every": 8},
    "bsp --transport ps --backup-workers 1": {"workers": 2, "transport": "ps", "backup_workers": 1},
    "--schedule bsp:2,local-sgd": {"workers": 2, "schedule": "bsp:2,local-sgd"},
    "--pipeline-stages 2": {"workers": 1, "pipeline_stages": 2},
    "--fsdp 2": {"workers": 1, "fsdp": 2},
}


def actors(options: dict) -> int:
    n = options.get("workers", 2) + options.get("backup_workers", 0)
    return n * options.get("pipeline_stages", 1) * options.get("fsdp", 1)


def fit(name: str, section: str, root: Path, **options) -> dict | None:
    import distrain

    if DEV == "cpu":
        options.pop("gpus_per_worker", None)
    run_dir = root / f"{section}-{len(list(root.iterdir()))}"
    t0 = time.perf_counter()
    try:
        result = distrain.fit(run_dir=str(run_dir), progress=False, **options)
    except Exception as e:  # noqa: BLE001
        record(section, name, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
        return None
    s = result.summary
    keep = (
        "status", "final_test_loss", "final_test_accuracy", "final_test_perplexity", "steps_completed",
        "steady_state_samples_per_s", "peak_memory_bytes", "gpu_peak_bytes", "overflow_steps", "nonfinite_steps",
        "recoveries", "failures", "mean_compute_s", "mean_comm_s",
    )  # fmt: skip
    fields = {k: s[k] for k in keep if k in s}
    fields["wall_s"] = round(time.perf_counter() - t0, 2)
    try:
        import pandas as pd

        rows = pd.read_parquet(run_dir / "metrics.parquet")
        steps = rows[rows["kind"] == "step"]
        for col in ("h2d_s", "gpu_util", "gpu_mem_bytes", "compute_s", "comm_s"):
            if col in steps and steps[col].notna().any():
                fields[f"median_{col}"] = float(steps[col].median())
        fields["_rows"] = str(run_dir / "metrics.parquet")
    except Exception as e:  # noqa: BLE001
        fields["metrics_error"] = repr(e)
    record(section, name, **fields)
    return fields


def run_strategies(root: Path, gpu: bool, epochs: int) -> None:
    section = "strategies" if gpu else "cpu"
    for name, options in STRATEGIES.items():
        if ONLY_STRATEGIES and name not in ONLY_STRATEGIES:
            continue
        if left() < 25:
            record(section, name, skipped="out of time")
            continue
        opts = dict(options, epochs=epochs)
        if gpu:
            opts["gpus_per_worker"] = 1.0 if actors(options) == 1 else round(1.0 / actors(options) - 0.005, 3)
        fit(name, section, root, **opts)


# ---------------------------------------------------------------------------------------------- lm


def plain_loop(precision: str, steps: int, batch: int) -> dict:
    """The example's model in a plain PyTorch loop on the GPU: same init, Adam lr 0.003, autocast."""
    import importlib.util

    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location("char_lm_plain", ROOT / "examples" / "char_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    task = mod.CharLM(**LM_GPU_ARGS)
    torch.manual_seed(0)
    model = task.build_model().to(DEV)
    train, _ = task.datasets()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(DEV) if precision == "fp16" else None
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    pin = DEV == "cuda"
    order = np.random.default_rng(0).permutation(len(train))
    warm = max(1, steps // 10)
    t_start = None
    for i in range(steps):
        if i == warm:
            sync()
            t_start = time.perf_counter()
        idx = order[(i * batch) % (len(order) - batch) :][:batch]
        x, y = train.get_batch(idx)
        if pin:
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(DEV, non_blocking=True), y.to(DEV, non_blocking=True)
        with torch.autocast(DEV, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
    sync()
    secs = time.perf_counter() - t_start
    del model, opt
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return {"tokens_per_s": (steps - warm) * batch * LM_GPU_ARGS["seq_len"] / secs, "last_loss": float(loss)}


def section_lm(root: Path) -> None:
    per_precision = {}
    for precision, round_ in ((p, r) for p in PRECISIONS for r in range(LM_ROUNDS)):
        if left() < 40:
            record("lm", precision, skipped="out of time")
            continue
        fields = fit(
            f"distrain bsp 1 worker {precision}", "lm", root, task=CHAR_LM, task_args=LM_GPU_ARGS, workers=1,
            gpus_per_worker=1.0, batch_size=LM_BATCH, optimizer="adam", lr=0.003, lr_scaling="none",
            epochs=1000, max_steps=LM_STEPS, eval_every=0, precision=precision,
        )  # fmt: skip
        plain = plain_loop(precision, LM_STEPS, LM_BATCH)
        seq = LM_GPU_ARGS["seq_len"]
        samples_per_s = (fields or {}).get("steady_state_samples_per_s")
        mine = samples_per_s * seq if samples_per_s else None
        per_precision[precision] = mine
        record(
            "lm", f"throughput {precision}", round=round_, distrain_tokens_per_s=mine,
            plain_tokens_per_s=plain["tokens_per_s"],
            ratio=(mine / plain["tokens_per_s"]) if mine else None, plain_last_loss=plain["last_loss"],
            distrain_final_test_loss=(fields or {}).get("final_test_loss"),
        )  # fmt: skip
    if per_precision.get("fp32"):
        record(
            "lm", "precision speed-up over fp32",
            **{p: v / per_precision["fp32"] for p, v in per_precision.items() if v},
        )  # fmt: skip


# ------------------------------------------------------------------------------------- overflow, chaos


def section_overflow(root: Path) -> None:
    import pandas as pd

    from distrain.trainers.task import ClassificationTask

    class LoudDigits(ClassificationTask):
        """The bundled digits MLP with a loss 1e4 times larger: fp16's starting scale overflows."""

        def __init__(self):
            super().__init__(model="mlp")

        def criterion(self, output, batch):
            return super().criterion(output, batch) * 1e4

    fields = fit(
        "fp16 overflow, bsp 2 workers", "overflow", root, task=LoudDigits, precision="fp16", workers=2,
        gpus_per_worker=0.49, epochs=3, lr=5e-6, momentum=0.9, eval_every=1,
    )  # fmt: skip
    if fields and "_rows" in fields:
        rows = pd.read_parquet(fields["_rows"])
        steps = rows[rows["kind"] == "step"]
        skipped = steps[steps["nonfinite"].fillna(False).astype(bool)]
        by_worker = {int(w): sorted(int(s) for s in g) for w, g in skipped.groupby("worker")["step"]}
        same = len(by_worker) == 2 and len(set(map(tuple, by_worker.values()))) == 1
        record("overflow", "skipped steps by worker", by_worker=by_worker, same=same)


def section_chaos(root: Path) -> None:
    common = dict(workers=2, gpus_per_worker=0.49, epochs=4, checkpoint_steps=10, deterministic=True, eval_every=1)
    plain = fit("bsp unbroken, --deterministic", "chaos", root, **common)
    broken = fit("bsp --chaos kill-worker@30:1, --deterministic", "chaos", root, chaos=["kill-worker@30:1"], **common)
    if plain and broken:
        a, b = plain["final_test_loss"], broken["final_test_loss"]
        record("chaos", "recovered vs unbroken", rel_diff=abs(a - b) / abs(a), within_1e_4=abs(a - b) / abs(a) <= 1e-4)


# ------------------------------------------------------------------------------------------------ ddp


def _ddp_rank(rank: int, world: int, port: int, steps: int, batch: int, device: str, task_args: dict, queue) -> None:
    import importlib.util

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = importlib.util.spec_from_file_location("char_lm_ddp", ROOT / "examples" / "char_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    task = mod.CharLM(**task_args)
    torch.manual_seed(0)
    model = DDP(task.build_model().to(device), device_ids=[0] if device == "cuda" else None)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    train, _ = task.datasets()
    order = np.random.default_rng(0).permutation(len(train))
    warm = max(1, steps // 10)
    t_start = None
    for i in range(steps):
        if i == warm:
            sync()
            dist.barrier()
            t_start = time.perf_counter()
        idx = order[(i * batch * world + rank * batch) % (len(order) - batch * world) :][:batch]
        x, y = train.get_batch(idx)
        if device == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync()
    secs = time.perf_counter() - t_start
    if rank == 0:
        queue.put((steps - warm) * batch * world / secs)
    dist.destroy_process_group()


def section_ddp(root: Path) -> None:
    import torch.multiprocessing as mp

    from distrain.strategies.collective import free_address

    steps, batch = 60, LM_BATCH // 2
    fields = fit(
        "distrain bsp 2 workers sharing the GPU", "ddp", root, task=CHAR_LM, task_args=LM_GPU_ARGS, workers=2,
        gpus_per_worker=0.49, batch_size=batch, optimizer="adam", lr=0.003, lr_scaling="none", epochs=1000,
        max_steps=steps, eval_every=0,
    )  # fmt: skip
    port = int(free_address("127.0.0.1").rsplit(":", 1)[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, port, steps, batch, DEV, LM_GPU_ARGS, queue)) for r in range(2)]
    for p in procs:
        p.start()
    ddp = queue.get(timeout=max(30, left() - 10))
    for p in procs:
        p.join(timeout=30)
    mine = (fields or {}).get("steady_state_samples_per_s")
    record("ddp", "bsp vs DDP (gloo, 2 ranks, one GPU)", distrain_samples_per_s=mine, ddp_samples_per_s=ddp,
           ratio=(mine / ddp) if mine else None)  # fmt: skip


def section_lm_algos(root: Path) -> None:
    for name, options in (("bsp", {}), ("diloco --sync-every 50", {"strategy": "diloco", "sync_every": 50})):
        fit(
            f"char-LM default shape, {name}", "lm_algos", root, task=CHAR_LM, task_args={"max_bytes": 300_000},
            workers=2, gpus_per_worker=0.49, batch_size=16, optimizer="adam", lr=0.003, lr_scaling="none", epochs=2,
            eval_every=1, **options,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------- comm


def section_comm(root: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import comm_efficient

    # BSP's target is its own loss after 2 epochs (a constant learning rate: its first 2 epochs are a
    # 2-epoch run), so BSP runs 2 epochs and DiLoCo up to 4 to reach it.
    results = []
    for name, epochs in (("bsp", 2), ("diloco", 4)):
        args = argparse.Namespace(
            workers=2, global_batch=32, epochs=epochs, seed=0, latency_ms=20.0, bandwidth=COMM_BANDWIDTH, sync_every=50
        )
        t0 = time.perf_counter()
        r = comm_efficient.run(name, args, root)
        results.append(r)
        record("comm", name, final_test_loss=r["final_loss"], wall_s=round(time.perf_counter() - t0, 1),
               mb_per_worker=r["bytes_total"] / 1e6, steps=r["steps"])  # fmt: skip
    target = float(results[0]["evals"]["val_loss"].iloc[1])  # BSP's loss after epoch 2
    times = [comm_efficient.to_target(r, target, 2)[0] for r in results]
    record("comm", "time to BSP's epoch-2 loss", target=target, bsp_s=times[0], diloco_s=times[1],
           sooner=(times[0] / times[1]) if times[0] and times[1] else None)  # fmt: skip


# ----------------------------------------------------------------------------------------------- main

SECTIONS = ("env", "probe", "strategies", "lm", "overflow", "chaos", "ddp", "comm", "lm_algos", "cpu")


def main() -> None:
    global OUT, BUDGET, DEV, ONLY_STRATEGIES, PRECISIONS, LM_ROUNDS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds; a section starts only with time left")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--epochs", type=int, default=4, help="epochs of the strategies' runs")
    ap.add_argument("--strategies", default="", help="'|'-separated names of STRATEGIES to run (default all)")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--lm-rounds", type=int, default=1, help="distrain, plain PyTorch, distrain, ... per precision")
    ap.add_argument("--small", action="store_true", help="the LM at its default shape, few steps (a CPU dry run)")
    args = ap.parse_args()
    OUT, BUDGET = Path(args.out), args.budget
    ONLY_STRATEGIES = [n for n in args.strategies.split("|") if n]
    PRECISIONS, LM_ROUNDS = args.precisions.split(","), args.lm_rounds
    if args.small:
        global LM_STEPS
        LM_GPU_ARGS.update(max_bytes=300_000, seq_len=64, dim=64, layers=2, heads=4)
        LM_STEPS = 30
    import torch

    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    OUT.mkdir(parents=True, exist_ok=True)
    only = [s.strip() for s in args.only.split(",")]
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    ray_started = False
    for name in only:
        if left() < 20:
            record(name, "section", skipped="out of time")
            continue
        if name not in ("env", "probe") and not ray_started:
            from distrain.orchestrator.cluster import start_local_ray

            start_local_ray(num_cpus=max(os.cpu_count() or 16, 8))  # a 2-core dry run: oversubscribed
            ray_started = True
        t0 = time.perf_counter()
        try:
            if name == "strategies":
                run_strategies(root, True, args.epochs)
            elif name == "cpu":
                run_strategies(root, False, args.epochs)
            elif name in ("env", "probe"):
                globals()[f"section_{name}"]()
            else:
                globals()[f"section_{name}"](root)
        except Exception as e:  # noqa: BLE001
            record(name, "section failed", error=repr(e)[:1000], traceback=traceback.format_exc()[-3000:])
        record(name, "section done", seconds=round(time.perf_counter() - t0, 1))
    print(f"total {time.perf_counter() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
