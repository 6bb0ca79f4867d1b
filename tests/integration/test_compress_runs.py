"""--compress on real runs (real Ray, real gloo groups): every place that moves tensors between workers
applies the codec, counts the bytes it put on the wire, and still trains.

The wiring is pinned by a codec that loses nothing: topk:1 sends every entry (the largest n of n), so a
run under it must equal the uncompressed run (to float tolerance: decode-then-average sums in another
order than a ring all-reduce). The codecs' own arithmetic is tested in test_compression*.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = dict(
        model="mlp", optimizer="sgd", momentum=0.0, lr=0.1, lr_scaling="none", epochs=2, max_steps=24, seed=5,
        workers=2, batch_size=16, segment_steps=8, eval_every=0, run_dir=str(tmp_path / name),
    )  # fmt: skip
    return RunConfig(**(base | kw))


def shapes_of(run_dir) -> list[torch.Size]:
    return [t.shape for t in load_checkpoint(run_dir / "checkpoints" / "final.pt")["model"].values()]


LOSSLESS = [
    ("bsp", {}),
    ("bsp-over-ps", dict(strategy="bsp", transport="ps", ps_shards=2)),
    ("local-sgd", dict(strategy="local-sgd", tau=4)),
    ("diloco", dict(strategy="diloco", sync_every=4)),
]


@pytest.mark.parametrize("name,kw", LOSSLESS, ids=[n for n, _ in LOSSLESS])
def test_a_codec_that_loses_nothing_gives_the_uncompressed_run(tmp_path, name, kw):
    plain = run_training(cfg(tmp_path, f"{name}-plain", **kw))
    coded = run_training(cfg(tmp_path, f"{name}-topk1", compress="topk:1", **kw))
    diff = (final_params(coded.run_dir) - final_params(plain.run_dir)).abs()
    assert diff.max().item() <= 1e-4 and diff.mean().item() <= 1e-6, (diff.max(), diff.mean())
    # ... while the wire carried values and their indices: twice the bytes, and it says so.
    rows = steps_of(coded.run_dir, sort_by=("worker", "step"))
    sent = rows[rows["bytes_sent"] > 0]
    assert len(sent) > 0 and sent["bytes_uncompressed"].notna().all()
    assert coded.summary["compress"] == "topk:1" and coded.summary["codec_ratio"] < 1
    assert steps_of(plain.run_dir, sort_by=("worker", "step"))["bytes_uncompressed"].isna().all()
    assert "codec_ratio" not in plain.summary  # no codec: the key does not apply (issue 26)


def codec_bytes(codec: str, shapes: list[torch.Size]) -> int:
    """What one worker of two puts on the wire for one compressed all-reduce of tensors of `shapes`."""
    n = sum(s.numel() for s in shapes)
    if codec in ("fp16", "bf16"):
        return 2 * n  # a ring all-reduce of 2n bytes: 2(P-1)/P x 2n with P = 2
    if codec == "int8":
        return n + 4 * math.ceil(n / 1024)  # all-gathered, (P-1) x payload: values and one scale a chunk
    if codec.startswith("topk:"):
        k = max(1, math.ceil(float(codec.split(":")[1]) * n))
        return 8 * k  # float32 values and int32 indices, all-gathered
    rank = int(codec.split(":")[1])
    values = 0
    for s in shapes:
        if len(s) < 2:
            values += s.numel()  # vectors travel as they are
        else:
            m, rest = s[0], s.numel() // s[0]
            r = min(rank, m, rest)
            # P and Q where they are smaller than the matrix (PyTorch's hook's rule), else the matrix
            values += r * (m + rest) if r * (m + rest) < m * rest else m * rest
    return 4 * values


CODECS = ["fp16", "bf16", "int8", "topk:0.1", "powersgd:4"]


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_with_bsp_trains_digits_and_counts_its_bytes(tmp_path, codec):
    config = RunConfig(
        model="mlp", epochs=4, workers=2, compress=codec, eval_every=1, run_dir=str(tmp_path / codec.replace(":", "-"))
    )
    run = run_training(config)
    assert run.summary["final_test_accuracy"] >= 0.95, run.summary
    shapes = shapes_of(run.run_dir)
    n = sum(s.numel() for s in shapes)
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    assert (rows["bytes_uncompressed"] == 4 * n).all()  # float32 ring all-reduce, P = 2
    assert (rows["bytes_sent"] == codec_bytes(codec, shapes)).all(), (rows["bytes_sent"].iloc[0], codec)
    assert run.summary["codec_ratio"] == pytest.approx(4 * n / codec_bytes(codec, shapes))


def test_diloco_with_int8_pseudo_gradients_reaches_the_usual_accuracy(tmp_path):
    """DiLoCo's defaults (H = 8, outer Nesterov SGD lr 0.7 momentum 0.9, inner SGD lr 0.01) on the mlp, with
    its pseudo-gradients in int8; uncompressed, the same run is test_diloco's default-run test."""
    # The whole training set (--val-fraction 0): with 10 % held out, 6 epochs of the mlp end near 0.90 (20 steps
    # an epoch instead of 22: fewer outer steps), compressed or not.
    config = RunConfig(
        strategy="diloco", model="mlp", epochs=6, compress="int8", val_fraction=0.0, run_dir=str(tmp_path / "dl-int8")
    )
    run = run_training(config)
    assert run.summary["final_test_accuracy"] >= 0.95, run.summary
    shapes = shapes_of(run.run_dir)
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    synced = rows[rows["bytes_sent"] > 0]
    assert len(synced) == 2 * run.summary["outer_steps"]  # one compressed all-reduce per outer step and worker
    assert (synced["bytes_sent"] == codec_bytes("int8", shapes)).all()
    assert run.summary["codec_ratio"] == pytest.approx(4 * sum(s.numel() for s in shapes) / codec_bytes("int8", shapes))


def test_local_sgd_compresses_theta_s_change_but_not_the_optimizer_state(tmp_path):
    """Momentum SGD: a round moves θ's change in int8 and the momentum buffer and AdaComm's three
    statistics in float32 (a ring all-reduce each)."""
    run = run_training(cfg(tmp_path, "local-int8", strategy="local-sgd", tau=4, momentum=0.9, compress="int8"))
    shapes = shapes_of(run.run_dir)
    n = sum(s.numel() for s in shapes)
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    rounds = rows[rows["bytes_sent"] > 0]
    assert len(rounds) == 2 * run.summary["averaging_rounds"]
    assert (rounds["bytes_sent"] == codec_bytes("int8", shapes) + 4 * (n + 3)).all()
    assert (rounds["bytes_uncompressed"] == 4 * n + 4 * (n + 3)).all()


def test_parameter_server_pushes_are_compressed_per_shard_and_pulls_are_not(tmp_path):
    run = run_training(
        cfg(tmp_path, "async-int8", strategy="async", ps_shards=2, compress="int8", max_steps=0, epochs=3, eval_every=1)
    )
    assert run.summary["final_test_accuracy"] >= 0.9, run.summary
    n = sum(s.numel() for s in shapes_of(run.run_dir))
    rows = steps_of(run.run_dir, sort_by=("worker", "step"))
    config = RunConfig.resolve(str(run.run_dir / "config.yaml"), {})
    assert config.ps_shards == 2
    assert (rows["bytes_received"] == 4 * n).all() and (rows["bytes_uncompressed"] == 4 * n).all()
    # Each shard's slice is its own int8 payload: n values and one scale per chunk of each slice.
    assert (rows["bytes_sent"] < n + 4 * (math.ceil(n / 1024) + 2)).all()
    assert (rows["bytes_sent"] >= n + 4 * math.ceil(n / 1024)).all()


def notices_into(notices: list[str]):
    """An event handler keeping the one-line notices a run gives (orchestrator/controller/events.py)."""
    from distrain.orchestrator.controller.events import Notice

    return lambda event: notices.append(event.text) if isinstance(event, Notice) else None


@pytest.mark.parametrize("transport", [{}, {"transport": "ps", "ps_shards": 2}], ids=["collective", "ps"])
def test_a_run_resumed_at_a_step_checkpoint_goes_on_with_every_rank_s_residuals(tmp_path, transport):
    """BSP under topk (error feedback), 2 workers: a run stopped right after its step-8 checkpoint and
    resumed ends bit-identical to the run taken straight through, because the checkpoint carries each
    rank's residuals (they differ per rank) and each rank gets its own back. Without them the resumed
    ranks' first pushes/all-reduces would send other values (shown once against the old code)."""
    from distrain.orchestrator.resume import resume_config
    from tests.helpers import assert_compact_checkpoint

    kw = dict(compress="topk:0.05", checkpoint_steps=8, **transport)
    straight = run_training(cfg(tmp_path, "straight", **kw))
    parts = run_training(cfg(tmp_path, "parts", **(kw | {"max_steps": 16})))
    ckpt = assert_compact_checkpoint(parts.run_dir / "checkpoints" / "step-00000008.pt")
    assert ckpt["version"] == 2 and ckpt["channel"]["codec"] == "topk:0.05"
    residuals = [s["grads"].get("reducer", {}).get("residual") for s in ckpt["channel"]["ranks"].values()]
    if transport:  # towards the shards: one residual per shard slice
        residuals = [torch.cat(s["grads"]["shards"]) for s in ckpt["channel"]["ranks"].values()]
    assert len(residuals) == 2 and not torch.equal(residuals[0], residuals[1])  # local: each rank its own
    assert all(r.numel() == final_params(parts.run_dir).numel() for r in residuals)
    assert set(load_checkpoint(parts.run_dir / "checkpoints" / "final.pt")["channel"]["ranks"]) == {0, 1}
    # Interrupted right after the step-8 checkpoint: latest.json names it, as it did then.
    pointer = parts.run_dir / "checkpoints" / "latest.json"
    pointer.write_text('{"name": "step-00000008.pt", "global_step": 8}\n')
    notices: list[str] = []
    resumed = run_training(resume_config(parts.run_dir, {"max_steps": 24}), on_event=notices_into(notices), resume=True)
    assert not [n for n in notices if "error-feedback" in n]  # restored: nothing to say
    assert torch.equal(final_params(resumed.run_dir), final_params(straight.run_dir))


def test_a_checkpoint_without_codec_state_resumes_with_zero_residuals_and_says_so(tmp_path):
    """A checkpoint written before the codec state was kept (no "channel" entry) still resumes: the
    residuals start at zero, as they always did, and the run says so in one line."""
    from distrain.orchestrator.resume import resume_config

    parts = run_training(cfg(tmp_path, "old", compress="topk:0.05", max_steps=16))
    path = parts.run_dir / "checkpoints" / "final.pt"
    payload = load_checkpoint(path)
    assert "channel" in payload
    torch.save({k: v for k, v in payload.items() if k != "channel"} | {"version": 1}, path)  # as version 1 wrote it
    notices: list[str] = []
    resumed = run_training(resume_config(parts.run_dir, {"max_steps": 24}), on_event=notices_into(notices), resume=True)
    assert resumed.summary["status"] == "completed"
    said = [n for n in notices if "error-feedback" in n]
    assert len(said) == 1 and "starts at zero" in said[0] and "holds none" in said[0], notices


def test_a_run_stopped_by_a_callback_resumes_from_its_final_checkpoint_with_every_rank_s_residuals(tmp_path):
    """A callback's stop moves the end after the workers were sent the segments ending there, so none
    of them shipped its residuals with them; the final checkpoint asks each worker for its own once all
    are done. Resumed from it, the run ends bit-identical to the one taken straight through (without
    the residuals the resumed ranks' first all-reduces would send other values)."""
    from distrain.orchestrator.callbacks import Callback
    from distrain.orchestrator.resume import resume_config

    class StopEarly(Callback):
        def on_rows(self, rows):
            return True  # at the first rows back: the end moves to the last step handed out

    kw = dict(compress="topk:0.05", segment_steps=4)
    straight = run_training(cfg(tmp_path, "straight", **kw))
    parts = run_training(cfg(tmp_path, "parts", **kw), callbacks=[StopEarly()])
    assert parts.summary["status"] == "stopped"
    final = load_checkpoint(parts.run_dir / "checkpoints" / "final.pt")
    assert 0 < final["global_step"] < 24 and final["global_step"] % 4 == 0
    assert set(final["channel"]["ranks"]) == {0, 1}
    notices: list[str] = []
    resumed = run_training(resume_config(parts.run_dir, {}), on_event=notices_into(notices), resume=True)
    assert not [n for n in notices if "error-feedback" in n]  # restored: nothing to say
    assert torch.equal(final_params(resumed.run_dir), final_params(straight.run_dir))


def test_a_range_over_the_ps_compresses_each_worker_s_push_with_its_own_residual(tmp_path):
    """--strategy bsp --transport ps --workers 2..3 with room for two (3 CPUs a worker of the fixture's 8: the
    membership never changes, and a round is 2 of a step's 3 slices): each worker's
    push goes through the codec with its own residual, nothing agreed across workers, so a range composes with
    --compress there. topk:1 loses nothing: the run equals the uncompressed range run; under int8 every push is
    the codec's n values and a scale per 1024-chunk of each shard's slice, against 4n float32 bytes."""
    kw = dict(strategy="bsp", transport="ps", ps_shards=2, workers="2..3", epochs=1, max_steps=8, cpus_per_worker=3.0)
    plain = run_training(cfg(tmp_path, "plain", **kw))
    runs = {
        codec: run_training(cfg(tmp_path, codec.replace(":", "-"), compress=codec, **kw))
        for codec in ("topk:1", "int8")
    }
    for run in (plain, *runs.values()):
        s = run.summary
        assert s["status"] == "completed" and s["failures"] == 0
        assert (s["membership"]["joins"], s["membership"]["leaves"], s["membership"]["final_members"]) == (0, 0, 2)
    diff = (final_params(runs["topk:1"].run_dir) - final_params(plain.run_dir)).abs()
    assert diff.max().item() <= 1e-5, diff.max()
    n = final_params(plain.run_dir).numel()
    rows = steps_of(runs["int8"].run_dir, sort_by=("worker", "step"))
    assert len(rows) == 8 * 3 and (rows["bytes_uncompressed"] == 4 * n).all()  # every slice of 8 steps once
    assert (rows["bytes_sent"] >= n + 4 * math.ceil(n / 1024)).all()
    assert (rows["bytes_sent"] < n + 4 * (math.ceil(n / 1024) + 2)).all()
    assert runs["int8"].summary["codec_ratio"] == pytest.approx(4 * n / rows["bytes_sent"].iloc[0])
