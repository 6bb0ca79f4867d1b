"""The emulated link across cut replicas (issue 28), over real gloo groups in real Ray actors: with
--comm-delay-ms the link is the one between replicas. R = 2 replicas of D = 2 FSDP workers under DiLoCo and
under local SGD pay the delay on exactly the averaging rounds (the channel's all-reduce of each worker's part
over the "replicate" group, on its own link), not on the inner/local steps, whose FSDP traffic stays inside the
replica; and the link only delays: the parameters are those of the same run without it. The same under
--workers MIN..MAX (DiLoCo's elastic blocks: their rounds go through the channel too)."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="mlp", lr_scaling="none", epochs=1, max_steps=8, seed=3, segment_steps=8, eval_every=0,
    optimizer="sgd", momentum=0.9, lr=0.05, workers=2, fsdp=2, batch_size=16,
)  # fmt: skip
DELAY = 0.05


RANGE = dict(workers="2..3", cpus_per_worker=2, hang_timeout_s=300.0, collective_timeout_s=60.0)  # 2 placed


# DiLoCo's all-reduce goes in the background (Channel.all_reduce_async): the link's clock starts at its launch,
# and its row counts the wait only, so the launch's own milliseconds may come off; a local SGD round waits it all,
# and so does an elastic block's round (strategies/elastic_cut.py: a blocking sum through the channel). Under the
# range (2 of MAX 3 replicas placed, 4 units a round of a step's 6) 8 steps are 12 rounds: 3 blocks of H = 4.
@pytest.mark.parametrize(
    "strategy, waited, round_steps, round_rows",
    [
        (dict(strategy="diloco", sync_every=4), 0.8 * DELAY, [3, 7], 8),
        (dict(strategy="local-sgd", tau=4), DELAY, [3, 7], 8),
        (dict(strategy="diloco", sync_every=4) | RANGE, DELAY, None, 12),
    ],
    ids=["diloco", "local-sgd", "diloco-range"],
)
def test_the_link_delays_exactly_the_rounds_across_cut_replicas_and_changes_nothing(
    tmp_path, strategy, waited, round_steps, round_rows
):
    runs = {
        name: run_training(RunConfig(**(BASE | strategy | {"run_dir": str(tmp_path / name)} | kw)))
        for name, kw in (("fast", {}), ("slow", dict(comm_delay_ms=DELAY * 1000)))
    }
    assert all(run.summary["status"] == "completed" for run in runs.values())
    gap = (final_params(runs["slow"].run_dir) - final_params(runs["fast"].run_dir)).abs().max().item()
    assert gap <= 1e-6, gap
    rows = steps_of(runs["slow"].run_dir)
    # A step's bytes beyond FSDP's inside the replica (the worker's step-0 bytes: no round there) are a round's.
    inside = rows[rows["step"] == 0].groupby("worker")["bytes_sent"].min()
    extra = rows["bytes_sent"] - rows["worker"].map(inside)
    rounds, inner = rows[extra > 0], rows[extra == 0]
    assert len(rounds) == round_rows and sorted(set(rounds["worker"])) == [0, 1, 2, 3]
    assert len(rounds) + len(inner) == len(rows)
    if round_steps is not None:  # a fixed size: every worker a row a step, the rounds every 4th step
        assert rows.groupby("step").size().eq(4).all() and sorted(set(rounds["step"])) == round_steps
    # The same traffic as without the link (bytes are the link's business only through their duration).
    fast = steps_of(runs["fast"].run_dir)
    assert fast["bytes_sent"].tolist() == rows["bytes_sent"].tolist()
    # Every round waited out the link's latency; the inner steps did not pay it (were they charged, each
    # would wait at least DELAY; measured ~0.5 ms: the median is robust to a loaded machine's stalls).
    # (FSDP's collectives run inside compute_s, on torch's group, never on the channel's link.)
    assert (rounds["comm_s"] >= waited).all(), rounds["comm_s"].min()
    assert inner["comm_s"].median() < DELAY, inner["comm_s"].describe()
