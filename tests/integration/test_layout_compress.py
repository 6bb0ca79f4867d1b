"""--compress across cut replicas (issue 28), over real gloo groups in real Ray actors: FSDP stays inside
each replica and the average across the R replicas goes through the channel's codec, part by part (each
worker's part with the R - 1 workers holding it elsewhere: the mesh's "replicate" group).

The wiring is pinned by a codec that loses nothing: topk:1 sends every entry of the part, so R = 2 x D = 2
BSP under it equals one process at the global batch (as plain HSDP does), and local SGD and DiLoCo over
R = 2 x D = 2 under it equal their runs over two plain replicas at twice the batch; the rows count what
the codec put on the wire (values and indices: twice the float32 bytes). A lossy codec (PowerSGD on each
worker's row block of a matrix) sends less than float32 and still trains digits; a run resumed from a
step checkpoint gives every worker its own residuals back (its part's) and ends bit-identical to the run
taken straight through."""

from __future__ import annotations

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from distrain.strategies.sharded_bsp import fsdp_bytes_per_step
from tests.helpers import final_params, steps_of
from tests.integration.test_compress_runs import codec_bytes, notices_into

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="mlp", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0,
    optimizer="sgd", momentum=0.9, lr=0.05,
)  # fmt: skip
TOL = 1e-5
CUT = dict(workers=2, fsdp=2, batch_size=16)  # two replicas of two FSDP workers: a global batch of 64
# The mlp's tensors, and each FSDP worker's part of them at D = 2 (dim 0 halved: every row count is even).
SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
PART = [torch.Size((s[0] // 2, *s[1:])) for s in SHAPES]
N = sum(torch.Size(s).numel() for s in SHAPES)
INSIDE = fsdp_bytes_per_step(4 * N, 1, 2, True)  # FSDP's traffic inside a replica, per worker and step


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



def test_bsp_under_a_lossless_codec_across_sharded_replicas_equals_one_process(tmp_path):
    one = run_training(cfg(tmp_path, "one", workers=1, batch_size=64))
    coded = run_training(cfg(tmp_path, "topk1", compress="topk:1", **CUT))
    assert coded.summary["status"] == "completed" and coded.summary["layout"]["worker_actors"] == 4
    assert (final_params(coded.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    rows = steps_of(coded.run_dir)
    assert len(rows) == 4 * 20
    # Per worker and step: FSDP's all-gathers and reduce-scatter inside its replica (no HSDP all-reduce),
    # and its part through the codec, all-gathered with the other replica's: n values and n indices (8
    # bytes an entry, P - 1 = 1) where float32 would have ring all-reduced 4 bytes an entry.
    part = sum(s.numel() for s in PART)
    assert (rows["bytes_sent"] == INSIDE + 8 * part).all(), rows["bytes_sent"].unique()
    assert (rows["bytes_uncompressed"] == INSIDE + 4 * part).all()
    assert coded.summary["codec_ratio"] == pytest.approx((INSIDE + 4 * part) / (INSIDE + 8 * part))
    # Tensor parallelism inside the replicas instead (T = 2 share a slice: B = 32): each worker's part of a
    # split layer, and its copy of the whole ones, averaged with the other replica's: the same end.
    tp = run_training(cfg(tmp_path, "tp", compress="topk:1", workers=2, tensor_parallel=2, batch_size=32))
    assert (final_params(tp.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "strategy", [dict(strategy="local-sgd", tau=4), dict(strategy="diloco", sync_every=4)], ids=["local-sgd", "diloco"]
)
def test_local_sgd_and_diloco_under_a_lossless_codec_across_sharded_replicas_equal_plain_replicas(tmp_path, strategy):
    """Their rounds (θ's change, then the optimizer state float32; DiLoCo's pseudo-gradient) go through the
    codec part by part and still average what two plain replicas at twice the batch average."""
    plain = run_training(cfg(tmp_path, "plain", workers=2, batch_size=32, **strategy))
    coded = run_training(cfg(tmp_path, "topk1", compress="topk:1", **(CUT | strategy)))
    assert (final_params(coded.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
    rows = steps_of(coded.run_dir)
    rounds = rows[rows["bytes_uncompressed"].notna()]
    assert sorted(set(rounds["step"])) == [3, 7, 11, 15, 19] and len(rounds) == 4 * 5
    part = sum(s.numel() for s in PART)
    # θ's change as topk:1 (8 bytes an entry) instead of float32 (4); local SGD's momentum after it
    # float32 (1 x its bytes at P = 2) and, for both, the 4 float64 statistics / 1 finiteness sum over the run.
    extra = rounds["bytes_sent"] - rounds["bytes_uncompressed"]
    assert (extra == 4 * part).all(), extra.unique()
    assert (rows[rows["bytes_uncompressed"].isna()]["bytes_sent"] == INSIDE).all()  # local steps: FSDP's own


def test_powersgd_on_sharded_replicas_trains_digits_and_sends_less(tmp_path):
    """PowerSGD on each worker's row block of every matrix (FSDP's dim-0 part: rank 4 of a 128 x 256 block),
    with error feedback per worker: every step sends what the codec says, below float32, and the run
    reaches the accuracy BSP under powersgd:4 reaches over two plain workers."""
    run = run_training(
        RunConfig(
            model="mlp", epochs=4, workers=2, fsdp=2, batch_size=16, compress="powersgd:4", eval_every=1,
            run_dir=str(tmp_path / "powersgd"),
        )  # fmt: skip
    )
    assert run.summary["final_test_accuracy"] >= 0.95, run.summary
    rows = steps_of(run.run_dir)
    part = sum(s.numel() for s in PART)
    assert (rows["bytes_sent"] == INSIDE + codec_bytes("powersgd:4", PART)).all(), rows["bytes_sent"].unique()
    assert (rows["bytes_uncompressed"] == INSIDE + 4 * part).all()
    # The codec's own part (PowerSGD's P and Q, the vectors float32) is over 10x below float32's; the row's
    # ratio is diluted by FSDP's float32 traffic inside the replica, which no codec touches.
    assert ((rows["bytes_uncompressed"] - INSIDE) > 10 * (rows["bytes_sent"] - INSIDE)).all()
    assert run.summary["codec_ratio"] == pytest.approx((INSIDE + 4 * part) / (INSIDE + codec_bytes("powersgd:4", PART)))
    losses = rows.groupby("step")["loss"].mean()
    assert losses.tail(10).mean() < 0.5 * losses.head(10).mean()


def test_a_sharded_run_resumed_at_a_step_checkpoint_goes_on_with_every_worker_s_residuals(tmp_path):
    """BSP under topk:0.05 at R = 2 x D = 2: the step-8 checkpoint holds each worker's residual of its part
    (four different ones, each the size of its part); resumed from it, the run ends bit-identical to the
    run taken straight through (without them the resumed workers' first all-reduces would send other
    values). (--resume at another layout is refused under a codec: orchestrator/resume.py.)"""
    kw = dict(compress="topk:0.05", checkpoint_steps=8, max_steps=16, **CUT)
    run = run_training(cfg(tmp_path, "run", **kw))
    straight = final_params(run.run_dir)
    ckpt = load_checkpoint(run.run_dir / "checkpoints" / "step-00000008.pt")
    assert ckpt["channel"]["codec"] == "topk:0.05" and "sharded" in ckpt
    residuals = [s["grads"]["reducer"]["residual"] for s in ckpt["channel"]["ranks"].values()]
    assert len(residuals) == 4 and all(r.numel() == sum(s.numel() for s in PART) for r in residuals)
    assert all(not torch.equal(a, b) for i, a in enumerate(residuals) for b in residuals[i + 1 :])
    (run.run_dir / "checkpoints" / "latest.json").write_text('{"name": "step-00000008.pt", "global_step": 8}\n')
    notices: list[str] = []
    resumed = run_training(resume_config(run.run_dir, {}), on_event=notices_into(notices), resume=True)
    assert resumed.summary["status"] == "completed"
    assert not [n for n in notices if "error-feedback" in n]  # restored: nothing to say
    assert torch.equal(final_params(resumed.run_dir), straight)


def test_the_cli_runs_what_it_refused_before(tmp_path, monkeypatch):
    """`distrain run --fsdp 2 --compress int8` was refused ("does not compose with --compress yet"): it runs."""
    from distrain.cli import app
    from tests.unit.test_cli_errors import runner

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "cli"
    args = ["run", "--model", "mlp", "--workers", "2", "--fsdp", "2", "--batch-size", "16", "--compress", "int8"]
    args += ["--epochs", "1", "--max-steps", "4", "--eval-every", "0", "--run-dir", str(run_dir)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = steps_of(run_dir)
    assert len(rows) == 4 * 4 and (rows["bytes_sent"] < rows["bytes_uncompressed"]).all()
