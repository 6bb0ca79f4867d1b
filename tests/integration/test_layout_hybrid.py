"""The cnn's hybrid tensor parallelism (Krizhevsky 2014) end to end over real gloo groups in real Ray actors:
the convolutions data-parallel over the T workers, each on its own samples, the classifier split across
them. T = 2 at --batch-size 16 and D = 2 x T = 2 at 8 equal one process at the global batch 32 after 20
steps of momentum SGD, test metrics included; DiLoCo across hybrid replicas equals DiLoCo across plain ones."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from distrain.strategies.sharded_bsp import fsdp_bytes_per_step
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="cnn", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0,
    optimizer="sgd", momentum=0.9, lr=0.05, workers=1,
)  # fmt: skip
TOL = 1e-5
CONVS = 1 * 32 * 9 + 32 + 32 * 64 * 9 + 64  # the cnn's convolutions' parameters on the 8x8 digits



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run = run_training(RunConfig(**BASE, batch_size=32, run_dir=str(tmp_path_factory.mktemp("one") / "run")))
    return run, final_params(run.run_dir), steps_of(run.run_dir)


@pytest.mark.parametrize("fsdp", [1, 2])
def test_the_cnn_hybrid_equals_one_process_at_t_times_the_batch(tmp_path, one_process, fsdp):
    one, params, one_rows = one_process
    run = run_training(RunConfig(**BASE, fsdp=fsdp, tensor_parallel=2, batch_size=16 // fsdp, run_dir=str(tmp_path)))
    assert run.summary["status"] == "completed" and run.summary["global_batch_size"] == 32
    assert (final_params(run.run_dir) - params).abs().max().item() <= TOL
    # Evaluation: each worker's Shard(0) logits are the whole eval batch's (its T workers feed the same batch).
    for metric in ("final_test_loss", "final_test_accuracy"):
        assert abs(run.summary[metric] - one.summary[metric]) <= TOL, metric
    rows = steps_of(run.run_dir)
    # Every worker takes its own slice (slice = rank = shard x T + tp) and counts its own samples.
    placed = rows.groupby("worker")[["shard", "tp", "slice"]].first().values.tolist()
    assert placed == [[d, t, 2 * d + t] for d in range(fsdp) for t in range(2)]
    assert (rows["samples"] == 16 // fsdp).all() and rows.groupby("step")["samples"].sum().eq(32).all()
    # Per step: FSDP's traffic over the worker's part, and the ring all-reduce of its part of the conv
    # gradients over the two tensor-parallel workers (2(T-1)/T = 1 x its bytes).
    held = CONVS + (1024 * 128 + 128) // 2 + 128 * 10 // 2 + 10
    traffic = fsdp_bytes_per_step(held * 4, 1, fsdp, True) + CONVS * 4 // fsdp
    assert (rows["bytes_sent"] == traffic).all()
    # Their own samples, their own losses, which average to one process's loss on all 32.
    by_step = rows.pivot_table(index="step", columns="worker", values="loss")
    assert (by_step[0] - by_step[1]).abs().min() > 1e-4
    assert abs(by_step.mean(axis=1).to_numpy() - one_rows["loss"].to_numpy()).max() <= TOL


def test_diloco_over_hybrid_replicas_equals_diloco_over_plain_replicas_at_t_times_the_batch(tmp_path):
    """R = 2 replicas of the T = 2 hybrid at B = 8 against 2 plain replicas at B = 16: each replica's inner
    steps take the same 16 samples, the outer steps average the same pseudo-gradients; 12 steps, H = 4.
    Run after the tests above in the module's Ray session, its warm workers have made meshes equal to its
    own with other process groups (trainers/sharded_trainer.py `forget_earlier_meshes`)."""
    lm = BASE | dict(strategy="diloco", sync_every=4, max_steps=12, workers=2)
    plain = run_training(RunConfig(**lm, batch_size=16, run_dir=str(tmp_path / "plain")))
    cut = run_training(RunConfig(**lm, tensor_parallel=2, batch_size=8, run_dir=str(tmp_path / "cut")))
    assert cut.summary["outer_steps"] == 3 and cut.summary["global_batch_size"] == 32
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
