"""The GPU path of a worker, checked on a machine with one CUDA GPU (and no Ray needed).

What `--gpus-per-worker` switches on inside a worker: the replica and its flat buffers on the GPU,
BSP's collective group on NCCL (a group of one: NCCL refuses two ranks on one GPU), the all-reduce
of the flat gradient buffer through NCCL, and evaluation on the GPU. It trains the default cnn on
digits for a few epochs with the same sharder, LR schedule and BSP strategy class a Ray worker uses,
checks the accuracy, and compares the parameters after the first steps with the same steps on CPU.

    python benchmarks/gpu_smoke.py [--epochs 4] [--model cnn]

Not part of the test suite (CI has no GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distrain.config import RunConfig  # noqa: E402
from distrain.strategies.base import StrategyContext  # noqa: E402
from distrain.strategies.bsp import BSP  # noqa: E402
from distrain.strategies.collective import free_address  # noqa: E402
from distrain.trainers.datasets import load_dataset  # noqa: E402
from distrain.trainers.local_trainer import LocalTrainer  # noqa: E402
from distrain.trainers.models import build_model  # noqa: E402
from distrain.trainers.schedule import LRSchedule  # noqa: E402
from distrain.trainers.sharding import EpochSharder  # noqa: E402
from distrain.trainers.task import ClassificationTask  # noqa: E402


def train(cfg: RunConfig, device: str, steps: int | None) -> tuple[LocalTrainer, float, int]:
    data = load_dataset(cfg.dataset)
    trainer = LocalTrainer(
        build_model(cfg.model, data.info, cfg.seed),
        ClassificationTask(cfg.model, cfg.dataset),
        cfg.optimizer,
        cfg.lr,
        cfg.momentum,
        cfg.weight_decay,
        device,
    )
    sharder = EpochSharder(data.train_size, cfg.global_batch_size, cfg.seed)
    schedule = LRSchedule.create(
        cfg.lr, cfg.global_batch_size, cfg.base_batch_size, cfg.lr_scaling, cfg.warmup_epochs, sharder.steps_per_epoch
    )
    strategy = BSP(cfg, StrategyContext(0, 1, device, free_address("127.0.0.1")))
    strategy.setup(trainer)
    assert strategy.group is not None
    if device.startswith("cuda"):
        assert dist.get_backend() == "nccl", dist.get_backend()
        probe = torch.ones(4, device=device)
        dist.all_reduce(probe)  # a real NCCL collective on the GPU buffer
        torch.cuda.synchronize()
    total = steps or cfg.epochs * sharder.steps_per_epoch
    t0 = time.perf_counter()
    for global_step in range(total):
        epoch, step = divmod(global_step, sharder.steps_per_epoch)
        x, y = data.train_batch(sharder.worker_indices(epoch, step, 0, 1))
        trainer.compute_gradients((x, y))
        strategy.group.all_reduce_mean_(trainer.grads_flat)
        trainer.apply_update(schedule.lr_at(global_step))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    strategy.teardown()
    return trainer, seconds, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--model", default="cnn")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    assert torch.cuda.is_available(), "no CUDA device"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}")
    cfg = RunConfig(workers=1, batch_size=64, epochs=args.epochs, model=args.model, gpus_per_worker=1)

    gpu, seconds, steps = train(cfg, "cuda", None)
    sums = gpu.evaluate(load_dataset(cfg.dataset).test_batches(512))
    acc = sums["accuracy"][0] / sums["accuracy"][1]
    print(f"GPU: {steps} steps in {seconds:.2f} s ({steps * 64 / seconds:,.0f} samples/s); test accuracy {acc:.4f}")

    # Same first 20 steps on CPU and GPU: same data, same init, same schedule. cuDNN's default TF32
    # convolutions round to 10-bit mantissas, so compare in full fp32 (and show the TF32 gap too).
    short_cpu, _, _ = train(cfg, "cpu", 20)
    diffs = {}
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        short_gpu, _, _ = train(cfg, "cuda", 20)
        diffs[tf32] = (short_gpu.params_flat.cpu().double() - short_cpu.params_flat.double()).abs().max().item()
        print(f"max |theta_gpu - theta_cpu| after 20 steps, TF32 {'on' if tf32 else 'off'}: {diffs[tf32]:.2e}")
    ok = acc >= 0.95 and diffs[False] < 1e-4
    print("GPU path OK" if ok else "GPU path FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
