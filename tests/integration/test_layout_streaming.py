"""Streaming DiLoCo across cut replicas (issue 28), over real gloo groups in real Ray actors.

A fragment is a set of whole tensors, cut by the whole tensors' sizes, so it is the same on every worker;
each worker of a cut replica holds its part (FSDP shard, tensor-parallel slice) of each of the fragment's
tensors and synchronises it with the workers holding that part in the other replicas (the mesh's
"replicate" group), on plain Streaming DiLoCo's schedule (strategies/fragments.py `FragmentRounds`). So
R = 2 replicas of D = 2 FSDP workers at B = 16, or of T = 2 tensor-parallel workers sharing B = 32, equal
two plain replicas at B = 32 with P = 2 fragments, τ = 1 and α = 0.5: the same staggered launches, the
same overlap, the same mix, each fragment's outer Nesterov momentum part by part. A lossless codec on each
fragment's stream changes nothing, and a run stopped at a step checkpoint and resumed (each worker reading
its part of every fragment's outer state back from the shards) ends where the straight run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator.checkpoint import load_checkpoint, whole_checkpoint
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from distrain.strategies.sharded_bsp import fsdp_bytes_per_step
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="mlp", lr_scaling="none", epochs=1, max_steps=12, seed=3, segment_steps=6, eval_every=0,
    optimizer="sgd", momentum=0.9, lr=0.05,
)  # fmt: skip
# P = 2 fragments of the mlp's 6 tensors (cut by their whole sizes: the first three, then the last three),
# synchronised in turn every H = 4 inner steps, each arriving τ = 1 step after it left, mixed in at α = 0.5.
STREAMING = dict(strategy="diloco", sync_every=4, fragments=2, overlap_steps=1, mix_alpha=0.5)
TOL = 1e-5
SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]
N = sum(torch.Size(s).numel() for s in SHAPES)
# Each FSDP worker's part of each fragment at D = 2 (dim 0 halved: every row count is even), in values.
PART = [sum(torch.Size(s).numel() // 2 for s in SHAPES[:3]), sum(torch.Size(s).numel() // 2 for s in SHAPES[3:])]
INSIDE = fsdp_bytes_per_step(4 * N, 1, 2, True)  # FSDP's traffic inside a replica, per worker and step


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | STREAMING | {"run_dir": str(tmp_path / name)} | kw))



@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Streaming DiLoCo over two plain replicas at B = 32: its final parameters and summary."""
    run = run_training(cfg(tmp_path_factory.mktemp("plain"), "plain", workers=2, batch_size=32))
    assert run.summary["status"] == "completed"
    return final_params(run.run_dir), run.summary


def test_streaming_diloco_over_sharded_replicas_equals_plain_replicas_at_twice_the_batch(tmp_path, plain):
    cut = run_training(cfg(tmp_path, "cut", workers=2, fsdp=2, batch_size=16))
    assert cut.summary["status"] == "completed" and cut.summary["layout"]["worker_actors"] == 4
    # Fragment 1 (offset H/2) at t = 2, 6, 10, fragment 0 at t = 4, 8, 12, and the run's end closes fragment 1
    # again: 7 fragment outer steps, as over plain replicas.
    assert cut.summary["outer_steps"] == plain[1]["outer_steps"] == 7
    assert (final_params(cut.run_dir) - plain[0]).abs().max().item() <= TOL
    # Each fragment goes on the wire alone at its own steps (row step s is inner step t = s + 1): the
    # worker's part of it, ring all-reduced with the other replica's (2(R-1)/R = 1 x its bytes); at the end
    # fragment 0's launch and the close's fragment 1 both.
    rows = steps_of(cut.run_dir)
    extra = (rows["bytes_sent"] - INSIDE).groupby(rows["step"]).unique()
    expected = {1: 4 * PART[1], 5: 4 * PART[1], 9: 4 * PART[1], 3: 4 * PART[0], 7: 4 * PART[0]}
    expected[11] = 4 * (PART[0] + PART[1])
    assert {s: list(v) for s, v in extra.items()} == {s: [expected.get(s, 0)] for s in range(12)}


def test_streaming_diloco_over_tensor_parallel_replicas_equals_plain_replicas(tmp_path, plain):
    """T = 2 workers share each replica's B = 32: each holds half of a split layer and a copy of the whole
    ones, every part averaged with the other replica's worker at its place."""
    tp = run_training(cfg(tmp_path, "tp", workers=2, tensor_parallel=2, batch_size=32))
    assert tp.summary["outer_steps"] == 7
    assert (final_params(tp.run_dir) - plain[0]).abs().max().item() <= TOL


def test_a_lossless_codec_on_each_fragments_stream_across_sharded_replicas_changes_nothing(tmp_path, plain):
    """topk:1 sends every entry of each fragment's part (values and indices: 8 bytes an entry where float32
    would have moved 4), blocking at its launch; the values are the uncompressed run's."""
    coded = run_training(cfg(tmp_path, "topk1", compress="topk:1", workers=2, fsdp=2, batch_size=16))
    assert (final_params(coded.run_dir) - plain[0]).abs().max().item() <= TOL
    rows = steps_of(coded.run_dir)
    on_wire = rows[rows["bytes_uncompressed"].notna()]
    assert sorted(set(on_wire["step"])) == [1, 3, 5, 7, 9, 11]
    assert ((on_wire["bytes_sent"] - INSIDE) == 2 * (on_wire["bytes_uncompressed"] - INSIDE)).all()


@pytest.mark.parametrize("outer", [{}, dict(outer_optimizer="adam", outer_lr=0.01)], ids=["nesterov", "adam"])
def test_a_resumed_sharded_streaming_run_ends_where_the_straight_run_ends(tmp_path, outer):
    """A step checkpoint at 8 closes the period (every fragment in flight arrives, every fragment changed
    since its sync steps), so θ_g is the model there; each worker writes its part of each fragment's outer
    state beside its shards and reads it back on --resume: the Nesterov momentum, or Adam's moments and
    each fragment's own step count (fragment 0 has stepped at t = 4, 8, fragment 1 at 2, 6 and the close).
    (Inner SGD without momentum: a checkpoint holds one replica's inner optimizer state, as under plain
    DiLoCo.)"""
    kw = dict(workers=2, fsdp=2, batch_size=16, momentum=0.0, checkpoint_steps=8) | outer
    straight = run_training(cfg(tmp_path, "straight", **kw))
    stopped = run_training(cfg(tmp_path, "stopped", **(kw | dict(max_steps=8))))
    resumed = run_training(resume_config(stopped.run_dir, {"max_steps": 12}), resume=True)
    assert resumed.summary["outer_steps"] == straight.summary["outer_steps"]
    assert (final_params(resumed.run_dir) - final_params(straight.run_dir)).abs().max().item() <= TOL
    # The resumed run's final checkpoint (in the stopped run's directory), read whole: both fragments' outer
    # state in DiLoCo's flat form (which a plain replica loads too), over every parameter value, in each
    # fragment's span; under Adam each fragment's own step count beside it.
    path = Path(stopped.run_dir) / "checkpoints" / "final.pt"
    state = whole_checkpoint(load_checkpoint(path), path)["strategy_state"]["state"]
    vector = state["outer_optimizer"]["vectors"]["exp_avg" if outer else "momentum_buffer"]
    first = 2 * PART[0]  # fragment 0's values, whole
    assert vector.numel() == N and vector[:first].abs().max() > 0 and vector[first:].abs().max() > 0
    # Fragment 0 at t = 4, 8, 12, fragment 1 at 2, 6, the close at 8, 10 and the close at 12.
    assert state["fragment_scalars"] == ([{"step": 3.0}, {"step": 5.0}] if outer else [{}, {}])
