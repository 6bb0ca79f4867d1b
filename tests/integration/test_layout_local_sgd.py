"""Local SGD and AdaComm across cut replicas, over real gloo groups in real Ray actors: R = 2 replicas of
D = 2 FSDP workers at B = 16 equal local SGD over 2 plain replicas at B = 32 (each replica's local steps
take the same 32 samples, a round averages the same parameters and momentum, part by part), and so do
R = 2 x T = 2 tensor-parallel replicas; τ = 1 equals BSP; an adaptive run chooses one τ on every worker,
the plain replicas' τ sequence, and resumes as they do. Every run after the first takes warm workers that
ran a sharded run before (Channel.device_mesh's cache clearing)."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(
    model="mlp", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0,
    strategy="local-sgd", optimizer="sgd", momentum=0.9, lr=0.05,
)  # fmt: skip
TOL = 1e-5
PLAIN = dict(workers=2, batch_size=32)  # two plain replicas at twice the batch
CUT = dict(workers=2, fsdp=2, batch_size=16)  # two replicas of two FSDP workers


def cfg(tmp_path, name: str, **kw) -> RunConfig:
    return RunConfig(**(BASE | {"run_dir": str(tmp_path / name)} | kw))



def test_local_sgd_over_sharded_replicas_equals_plain_replicas_at_twice_the_batch(tmp_path):
    plain = run_training(cfg(tmp_path, "plain", tau=4, **PLAIN))
    cut = run_training(cfg(tmp_path, "cut", tau=4, **CUT))
    assert cut.summary["status"] == "completed" and cut.summary["averaging_rounds"] == 5
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
    rows = steps_of(cut.run_dir)
    assert (rows["tau"] == 4).all() and rows.groupby("step")["averaging_round"].nunique().eq(1).all()
    assert rows.groupby("step")["averaging_round"].first().tolist() == [s // 4 for s in range(1, 21)]
    # A round moves the worker's own part of θ's change and of the momentum across the two replicas:
    # 2(R-1)/R = 1 x their bytes, i.e. twice the parameter bytes it holds, beside FSDP's per-step traffic
    # inside the replica, and the 4 float64 statistics summed over the 4 workers (2 x 3/4 x 32 bytes).
    local = rows[rows["step"] == 0].set_index("worker")["bytes_sent"]
    for step in (3, 7, 11, 15, 19):
        rnd = rows[rows["step"] == step].set_index("worker")
        assert ((rnd["bytes_sent"] - local) == 2 * rnd["mem_param_bytes"] + 48).all(), step
    # Tensor parallelism inside the replicas instead (T = 2 share a slice: B = 32): the same end.
    tp = run_training(cfg(tmp_path, "tp", tau=4, workers=2, tensor_parallel=2, batch_size=32))
    assert (final_params(tp.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL


def test_tau_one_over_sharded_replicas_is_bsp(tmp_path):
    """Parameters and momentum averaged after every local step: momentum SGD on the mean gradient."""
    bsp = run_training(cfg(tmp_path, "bsp", strategy="bsp", max_steps=10, workers=1, batch_size=64))
    one = run_training(cfg(tmp_path, "tau1", tau=1, max_steps=10, **CUT))
    assert one.summary["averaging_rounds"] == 10
    assert (final_params(one.run_dir) - final_params(bsp.run_dir)).abs().max().item() <= TOL


def test_adaptive_tau_over_sharded_replicas_agrees_on_every_worker(tmp_path):
    """AdaComm's statistics are summed over every worker of the run, so all four choose the same τ at
    every step, and it is the τ the plain replicas choose (the mean of the four half-batch losses is the
    mean of the two whole ones), so the runs end alike too."""
    ada = dict(tau=4, adaptive_tau=True, tau_interval="4", lr=0.1)
    plain = run_training(cfg(tmp_path, "plain", **(ada | PLAIN)))
    cut = run_training(cfg(tmp_path, "cut", **(ada | CUT)))
    rows = steps_of(cut.run_dir)
    assert rows.groupby("step")["tau"].nunique().eq(1).all() and rows.groupby("step").size().eq(4).all()
    taus = steps_of(plain.run_dir).groupby("step")["tau"].first().tolist()
    assert rows.groupby("step")["tau"].first().tolist() == taus and len(set(taus)) > 1, taus
    assert cut.summary["tau_changes"] == plain.summary["tau_changes"]
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL


def test_an_adaptive_run_over_sharded_replicas_resumes_as_plain_replicas_do(tmp_path):
    """10 steps, then --resume to 20: the checkpoint keeps τ, the rounds and AdaComm's F_0 (the strategy's
    extra state), so the resumed cut run goes on as the resumed plain one does (its period was cut at the
    checkpoint alike)."""
    ada = dict(tau=4, adaptive_tau=True, tau_interval="4", lr=0.1, max_steps=10)
    ends = {}
    for name, layout in (("plain", PLAIN), ("cut", CUT)):
        first = run_training(cfg(tmp_path, name, **(ada | layout)))
        resumed = run_training(resume_config(first.run_dir, {"max_steps": 20}), resume=True)
        rows = steps_of(resumed.run_dir).groupby("step")[["tau", "averaging_round"]].first()
        ends[name] = (final_params(resumed.run_dir), rows)
    assert ends["cut"][1].equals(ends["plain"][1]) and ends["cut"][1].loc[10, "averaging_round"] == 3
    assert (ends["cut"][0] - ends["plain"][0]).abs().max().item() <= TOL
