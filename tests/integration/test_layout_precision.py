"""--precision across cut replicas (issue 28): FSDP2's MixedPrecisionPolicy under --fsdp (bf16 compute,
float32 reduction, float32 parameters and optimizer state), autocast over DTensors under
--tensor-parallel alone, and fp16's loss scale with one skip decision for every worker of the run.
Real Ray actors over gloo on the CPU, the bundled digits and mlp, a few steps each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import distrain
from distrain.orchestrator.checkpoint import load_checkpoint, whole_checkpoint
from distrain.strategies.sharded_bsp import fsdp_bytes_per_step
from distrain.trainers.task import ClassificationTask
from tests.helpers import LoudDigits, final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
MLP_PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
HSDP = dict(workers=2, fsdp=2, batch_size=32, lr_scaling="none", seed=3, segment_steps=10)
SGD = dict(optimizer="sgd", momentum=0.9, lr=0.05)



def fit(tmp_path, name: str, **options) -> distrain.FitResult:
    return distrain.fit(run_dir=str(tmp_path / name), progress=False, **options)


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory):
    """R = 2 x D = 2 under BSP (HSDP), 3 epochs of the digits (10 steps each at the global batch 128):
    float32 and bf16, one evaluation at the end."""
    base = tmp_path_factory.mktemp("hsdp")
    return {
        precision: fit(base, precision, model="mlp", precision=precision, epochs=3, eval_every=3, **HSDP, **SGD)
        for precision in ("fp32", "bf16")
    }


# bf16 keeps 8 significant bits: each layer's output (and the gradient with it) is rounded to ~0.4%
# relative, so the parameters drift from the float32 run's by a fraction of the updates. Measured here:
# after 30 SGD steps (momentum 0.9, lr 0.05) at R = 2 x D = 2, 3.1e-3 at most in the parameters, 1.2e-3
# in a step's mean loss, the same test accuracy (0.936); after 10 steps at T = 2 and at D = 2 x T = 2,
# 1.0e-3 and 4.7e-4; the batch-norm mlp at D = 2 after 10 steps, 3.5e-3. The bounds leave >= 1.4x and
# ~4x room over those (the runs are deterministic: fixed seed, gloo's fixed reduction order). A run
# computing in float32 would be < 1e-5 apart (fp32 HSDP equals one process within 1e-5:
# test_layout_runs.py), hence the lower bound: bf16 really ran.
BF16_PARAM_TOL = 5e-3
BF16_LOSS_TOL = 5e-3


def test_bf16_hsdp_tracks_float32_keeps_float32_parameters_and_trains(hsdp_runs):
    fp32, bf16 = hsdp_runs["fp32"], hsdp_runs["bf16"]
    assert fp32.status == bf16.status == "completed"
    gap = (final_params(bf16.run_dir) - final_params(fp32.run_dir)).abs().max().item()
    assert 1e-5 < gap <= BF16_PARAM_TOL, gap  # computed in bf16 (not float32), and close to it
    loss32 = steps_of(fp32.run_dir).groupby("step")["loss"].mean()
    loss16 = steps_of(bf16.run_dir).groupby("step")["loss"].mean()
    assert len(loss16) == 30 and (loss16 - loss32).abs().max() <= BF16_LOSS_TOL
    assert bf16.metrics["test_accuracy"] >= 0.9, bf16.metrics  # measured 0.936, as fp32's
    # The shards FSDP keeps, their gradients and the optimizer's state stay float32: each replica's two
    # workers hold the whole model's float32 bytes between them, as under fp32.
    rows = steps_of(bf16.run_dir)
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    held32 = steps_of(fp32.run_dir).groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    assert held.equals(held32) and held["mem_param_bytes"].sum() == 2 * MLP_PARAMS * 4
    path = Path(bf16.run_dir) / "checkpoints" / "final.pt"
    state = whole_checkpoint(load_checkpoint(path), path)
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
    # FSDP gathers the parameters in bf16 (2 bytes each) and reduces the gradient in float32.
    whole = MLP_PARAMS * 4
    assert (rows["bytes_sent"] == fsdp_bytes_per_step(whole, 2, 2, True, gather_bytes=whole // 2)).all()
    assert (steps_of(fp32.run_dir)["bytes_sent"] == fsdp_bytes_per_step(whole, 2, 2, True)).all()


@pytest.mark.parametrize("strategy", ["bsp", "local-sgd", "diloco"])
def test_fp16_overflows_skip_the_same_steps_on_every_worker_of_every_replica(tmp_path, strategy):
    extra = {"bsp": {}, "local-sgd": {"tau": 4}, "diloco": {"sync_every": 4}}[strategy]
    result = fit(
        tmp_path, strategy, task=LoudDigits, precision="fp16", strategy=strategy, epochs=3, max_steps=24,
        eval_every=0, **HSDP | {"lr": 5e-6, "momentum": 0.9}, **extra,
    )  # fmt: skip
    assert result.status == "completed", result.summary
    rows = steps_of(result.run_dir)
    skipped = rows[rows["nonfinite"].fillna(False).astype(bool)]
    by_worker = skipped.groupby("worker")["step"].apply(sorted).to_dict()
    # The starting scale overflows somewhere in the gradient: only some workers' shards hold the inf, yet
    # all four (two shards of two replicas) skipped exactly the same steps, each marked an overflow.
    assert set(by_worker) == {0, 1, 2, 3} and len({tuple(s) for s in by_worker.values()}) == 1, by_worker
    overflows = by_worker[0]
    assert len(overflows) >= 3 and overflows == list(range(len(overflows))), overflows
    assert skipped["overflow"].eq(True).all() and result.summary["overflow_steps"] == len(overflows)
    final = load_checkpoint(Path(result.run_dir) / "checkpoints" / "final.pt")
    assert final["scaler"]["overflows"] == len(overflows)
    assert final["scaler"]["scale"] == 2.0**16 / 2 ** len(overflows)
    sums = rows.pivot(index="step", columns="worker", values="train_param_sum")
    # A skipped step changed no worker's piece ...
    for step in overflows:
        assert (sums.loc[step + 1] == sums.loc[step]).all(), step
    assert (sums.loc[23] != sums.loc[len(overflows)]).all()  # ... and the steps after them trained
    if strategy == "bsp":  # HSDP: both replicas' worker d hold the same piece at every step
        assert (sums[0] == sums[2]).all() and (sums[1] == sums[3]).all()
    else:  # local SGD, DiLoCo: the replicas are equal again after each round (every 4 steps, and at epoch ends)
        round_of = rows.groupby("step")["averaging_round"].first()
        ends = [s for s in round_of.index[:-1] if round_of[s] > round_of.get(s - 1, 0)]
        assert len(ends) >= 5, round_of.tolist()
        for step in ends:
            after = sums.loc[step + 1]
            assert after[0] == after[2] and after[1] == after[3], step
        assert (sums.loc[22, [0, 1]].to_numpy() != sums.loc[22, [2, 3]].to_numpy()).all()  # between rounds apart


def test_bf16_bsp_over_the_ps_equals_bf16_hsdp(tmp_path, hsdp_runs):
    """bsp over --transport ps at R = 2 x D = 2 (strategies/sharded_ps.py) equals one process in fp32, as HSDP
    does; in bf16 (FSDP's policy inside each replica, float32 chunks pushed, the shards' mean of the R
    replicas' chunks where HSDP all-reduces them) it equals the bf16 HSDP run (measured: bit for bit)."""
    run = fit(tmp_path, "ps16", model="mlp", precision="bf16", transport="ps", epochs=3, eval_every=3, **HSDP, **SGD)
    assert run.status == "completed"
    assert (final_params(run.run_dir) - final_params(hsdp_runs["bf16"].run_dir)).abs().max().item() <= 1e-5
    gap = (final_params(run.run_dir) - final_params(hsdp_runs["fp32"].run_dir)).abs().max().item()
    assert 1e-5 < gap <= BF16_PARAM_TOL, gap
    assert run.metrics["test_accuracy"] >= 0.9, run.metrics
    assert steps_of(run.run_dir).groupby("worker")["mem_param_bytes"].max().sum() == 2 * MLP_PARAMS * 4


def test_fp16_async_over_the_ps_skips_an_overflow_on_every_worker_of_the_replica(tmp_path):
    """async over the PS: a replica's D workers decide an overflow together (an inf in one's chunks skips
    both pushes); each replica keeps its own scale, as plain workers under the PS do."""
    result = fit(
        tmp_path, "async", task=LoudDigits, precision="fp16", strategy="async", transport="ps", epochs=3,
        max_steps=24, eval_every=0, **HSDP | {"lr": 5e-6, "momentum": 0.9},
    )  # fmt: skip
    assert result.status == "completed", result.summary
    rows = steps_of(result.run_dir)
    skipped = rows[rows["nonfinite"].fillna(False).astype(bool)]
    by_worker = {w: sorted(skipped[skipped["worker"] == w]["step"]) for w in range(4)}
    assert by_worker[0] == by_worker[1] and by_worker[2] == by_worker[3], by_worker  # (r, 0) and (r, 1) agree
    assert all(len(steps) >= 3 for steps in by_worker.values()), by_worker
    assert skipped["overflow"].eq(True).all() and not rows["loss"].isna().any()
    final = load_checkpoint(Path(result.run_dir) / "checkpoints" / "final.pt")
    assert final["scaler"]["scale"] == 2.0**16 / 2 ** final["scaler"]["overflows"]
    assert final["scaler"]["overflows"] == len(by_worker[0])  # worker 0's scale


class NormDigits(ClassificationTask):
    """The digits through Linear, BatchNorm1d (running statistics: float32 buffers), ReLU, Linear."""

    def __init__(self):
        super().__init__(model="mlp")

    def build_model(self):
        from torch import nn

        return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


def test_bf16_fsdp_runs_batch_norm_in_float32_units(tmp_path):
    """FSDP's bf16 policy leaves buffers float32, and torch's batch_norm refuses bf16 parameters with float32
    running statistics: each such layer is a float32 unit of its own (sharded_trainer.norm_policy)."""
    kw = dict(task=NormDigits, workers=1, fsdp=2, batch_size=32, epochs=1, max_steps=10, eval_every=1, seed=3, **SGD)
    ref, run = fit(tmp_path, "fp32", **kw), fit(tmp_path, "bf16", precision="bf16", **kw)
    assert ref.status == run.status == "completed", run.summary
    gap = (final_params(run.run_dir) - final_params(ref.run_dir)).abs().max().item()
    assert 1e-5 < gap <= BF16_PARAM_TOL, gap
    path = Path(run.run_dir) / "checkpoints" / "final.pt"
    state = whole_checkpoint(load_checkpoint(path), path)["model"]
    assert state["2.running_mean"].dtype == torch.float32 and state["2.running_var"].abs().sum() > 0
    assert abs(run.metrics["test_loss"] - ref.metrics["test_loss"]) <= BF16_LOSS_TOL * 10, (run.metrics, ref.metrics)


TP = dict(model="mlp", workers=1, lr_scaling="none", seed=3, epochs=1, max_steps=10, eval_every=0, **SGD)


def test_tensor_parallel_bf16_runs_under_autocast_and_with_fsdp_tracks_float32(tmp_path):
    """T = 2 alone: autocast over the DTensor layers; D = 2 x T = 2: FSDP's policy over the split layers.
    Both against T = 2 in float32 at the same global batch 64."""
    ref = fit(tmp_path, "tp32", tensor_parallel=2, batch_size=64, **TP)
    tp = fit(tmp_path, "tp16", tensor_parallel=2, batch_size=64, precision="bf16", **TP)
    both = fit(tmp_path, "dtp16", fsdp=2, tensor_parallel=2, batch_size=32, precision="bf16", **TP)
    assert ref.status == tp.status == both.status == "completed"
    base = final_params(ref.run_dir)
    loss32 = steps_of(ref.run_dir).groupby("step")["loss"].mean()
    for run in (tp, both):
        gap = (final_params(run.run_dir) - base).abs().max().item()
        assert 1e-5 < gap <= BF16_PARAM_TOL, (run.run_dir, gap)
        loss = steps_of(run.run_dir).groupby("step")["loss"].mean()
        assert len(loss) == 10 and (loss - loss32).abs().max() <= BF16_LOSS_TOL
