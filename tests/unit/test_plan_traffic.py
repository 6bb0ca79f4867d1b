"""The planner's traffic under --compress and on the emulated network (--comm-delay-ms, --comm-bandwidth):
bytes from the codecs' own encoding of a real tensor of the model, equal to what the compressed collective
counts when it runs; step time on an emulated link as strategies/network.py charges it. No Ray."""

from __future__ import annotations

import types

import pytest
import torch

from distrain.compression import parse_codec
from distrain.config import RunConfig
from distrain.orchestrator.run_checks import check_runnable
from distrain.planning import planner
from distrain.planning.calibrate import traffic_figures
from distrain.strategies import compressed_collective
from distrain.strategies.compressed_collective import CompressedAllReduce
from distrain.strategies.partition import partition
from tests.unit.test_planner import _cal

CODECS = ["fp16", "bf16", "int8", "topk:0.05", "powersgd:2"]


def _mlp_gradient() -> tuple[list[torch.Size], torch.Tensor]:
    """A real gradient of the built-in mlp on digits (one backward on a batch)."""
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import build_model

    info = DATASETS.get("digits").info
    torch.manual_seed(0)
    net = build_model("mlp", info, 0)
    net(torch.randn(16, info.channels, info.height, info.width)).square().mean().backward()
    params = [p for p in net.parameters() if p.requires_grad]
    return [p.shape for p in params], torch.cat([p.grad.reshape(-1) for p in params])


@pytest.fixture
def loopback(monkeypatch):
    """Collectives of a world of P ranks that all hold this rank's values: the compressed all-reduce runs
    its whole path (and counts its bytes) without a process group."""

    def all_gather(out, tensor, group=None):
        for t in out:
            t.copy_(tensor)

    fake = types.SimpleNamespace(all_reduce=lambda tensor, op=None, group=None: None, all_gather=all_gather,
                                 ReduceOp=types.SimpleNamespace(SUM=None))  # fmt: skip
    monkeypatch.setattr(compressed_collective, "dist", fake)


@pytest.mark.parametrize("codec", CODECS)
def test_planned_bytes_equal_what_the_compressed_all_reduce_counts(codec, loopback):
    shapes, grad = _mlp_gradient()
    cfg = RunConfig(model="mlp", compress=codec)
    cal = _cal(num_params=grad.numel(), **traffic_figures(cfg, check_runnable(cfg)))
    for p in (2, 4, 8):
        counted = CompressedAllReduce(parse_codec(codec), p, grad.numel(), shapes).all_reduce_mean_(grad.clone())
        assert planner.predict(cal, "bsp", "collective", p).bytes_per_worker == counted
        assert planner.predict(cal, "diloco", "collective", p, settings={"sync_every": 10}).bytes_per_worker == (
            pytest.approx(counted / 10)
        )
        if p <= 4:  # an all-gather's (P-1) x payload outgrows fp32's ring by P = 8 for int8: planned as counted
            assert counted < planner.ring_bytes_per_worker(grad.numel() * 4, p)
    assert planner.predict(cal, "bsp", "collective", 1).bytes_per_worker == 0  # one worker sends nothing


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.05"])
def test_a_compressed_push_is_the_shards_encoded_slices(codec):
    shapes, grad = _mlp_gradient()
    cfg = RunConfig(model="mlp", strategy="async", ps_shards=3, compress=codec)
    cal = _cal(num_params=grad.numel(), **traffic_figures(cfg, check_runnable(cfg)))
    spec = parse_codec(codec)
    pushed = sum(spec.build().encode(grad[lo:hi].clone()).nbytes for lo, hi in partition(grad.numel(), 3))
    assert planner.predict(cal, "async", "ps", 4).bytes_per_worker == pushed < grad.numel() * 4
    plain = planner.predict(_cal(num_params=grad.numel()), "async", "ps", 4)
    assert plain.bytes_per_worker == grad.numel() * 4
    # fewer bytes out: a shorter round trip, by the bytes saved at the measured PS rate
    faster = plain.comm_s - planner.predict(cal, "async", "ps", 4).comm_s
    assert faster == pytest.approx((grad.numel() * 4 - pushed) / cal.ps_bandwidth)


def test_an_emulated_link_sets_the_step_by_the_ring_bytes_and_one_delay_per_transfer():
    n = 1_000_000  # 4 MB of float32 gradient: 1 MiB first bucket, then 25 MiB ones: two buckets
    bw = 12.5e6  # 100 Mbit/s
    steps = {}
    for delay in (0.0, 0.02, 0.05):
        cal = _cal(num_params=n, compute_s=0.01, link_latency_s=delay, link_bandwidth=bw, buckets=2)
        steps[delay] = {p: planner.predict(cal, "bsp", "collective", p) for p in (1, 2, 4)}
    for p in (2, 4):
        link = planner.ring_bytes_per_worker(n * 4, p) / bw  # 2(P-1)n/P bytes at the link's rate
        hidden = steps[0.0][p].compute_s * 2 / 3 * (2 - 1) / 2  # the first bucket's transfer starts in backward
        assert steps[0.0][p].comm_s == pytest.approx(link - hidden)
        # each delay adds once per transfer (network.py), the buckets' two transfers
        assert steps[0.05][p].step_s - steps[0.02][p].step_s == pytest.approx(2 * 0.03)
        assert steps[0.05][p].step_s > steps[0.05][p - 1 if p == 2 else 2].step_s  # more bytes at larger P
    assert steps[0.05][1].comm_s == steps[0.0][1].comm_s == 0.0  # one worker: nothing sent, nothing waited
    # local SGD: one transfer of θ and the optimizer state per round, amortised over τ
    cal = _cal(num_params=n, link_latency_s=0.05, link_bandwidth=bw, optimizer_copies=1)
    local = planner.predict(cal, "local-sgd", "collective", 4, settings={"tau": 8})
    assert local.comm_s == pytest.approx((0.05 + planner.ring_bytes_per_worker(2 * n * 4, 4) / bw) / 8)
    # the PS: one transfer per push-pull, the push and the pull of θ
    ps = planner.predict(cal, "async", "ps", 1)
    assert ps.comm_s == pytest.approx(0.05 + 2 * n * 4 / bw)
    # a what-if machine plans for its own link, not the run's emulated one
    hw = planner.Hardware("x", 1e10, 1e-6)
    assert planner.predict(cal, "bsp", "collective", 4, hw).comm_s < 0.01


def test_compression_and_the_emulated_link_together_shrink_the_wait_for_the_link():
    shapes, grad = _mlp_gradient()
    cfg = RunConfig(model="mlp", compress="int8", comm_delay_ms=1.0, comm_bandwidth="10mbit")
    figures = traffic_figures(cfg, check_runnable(cfg))
    assert figures["link_latency_s"] == 0.001 and figures["link_bandwidth"] == 10e6 / 8
    cal = _cal(num_params=grad.numel(), **figures)
    plain = _cal(num_params=grad.numel(), **(figures | {"codec": None, "codec_parts": [], "ps_push_bytes": None}))
    int8 = planner.predict(cal, "bsp", "collective", 4)
    fp32 = planner.predict(plain, "bsp", "collective", 4)
    assert int8.comm_s == pytest.approx(0.001 + int8.bytes_per_worker / (10e6 / 8))  # one all-gather
    # an all-gather of int8 at P=4: (P-1) x n/4 against fp32's ring 2(P-1)n/P: about half the bytes and time
    assert int8.bytes_per_worker == pytest.approx(fp32.bytes_per_worker / 2, rel=0.01)
    # (fp32 goes in BSP's buckets, one latency each, partly hidden behind backward: the mlp's 0.34 MB is two,
    # the first a quarter of it, collective.first_bucket_cap)
    assert figures["buckets"] == 2
    assert int8.comm_s == pytest.approx(fp32.comm_s / 2, rel=0.03)


def test_local_sgd_and_diloco_rounds_include_the_epoch_ends():
    """local_sgd.py: a round after every τ local steps and after an epoch's last step if one is pending
    (the period starts afresh each epoch); the planner's rounds per step equal that schedule's count."""
    cal = _cal(num_params=85_002, train_samples=1438, batch_size=32, optimizer_copies=1)

    def simulated(period: int, workers: int, epochs: int = 7) -> float:
        steps_per_epoch = 1438 // (32 * workers)  # the last partial global batch is dropped (sharding.py)
        rounds = 0
        for _ in range(epochs):
            pending = 0
            for _ in range(steps_per_epoch):
                pending += 1
                if pending == period:
                    rounds, pending = rounds + 1, 0
            rounds += pending > 0
        return rounds / (epochs * steps_per_epoch)

    for workers, period in ((2, 8), (2, 50), (4, 8), (4, 5), (1, 8)):
        assert cal.rounds_per_step(period, workers) == pytest.approx(simulated(period, workers))
    assert cal.rounds_per_step(50, 2) == pytest.approx(1 / 22)  # DiLoCo H=50 on digits at N=2: every epoch end
    local = planner.predict(cal, "local-sgd", "collective", 2, settings={"tau": 8})
    assert local.bytes_per_worker == pytest.approx(planner.ring_bytes_per_worker(2 * 85_002 * 4, 2) * 3 / 22)
    assert _cal(num_params=85_002).rounds_per_step(8, 2) == 1 / 8  # a user's task: no epoch size, τ alone


def test_a_codec_the_parameter_server_refuses_leaves_it_out_of_the_plan():
    cfg = RunConfig(model="mlp", compress="powersgd:2")
    cal = _cal(num_params=85_002, **traffic_figures(cfg, check_runnable(cfg)))
    assert not cal.ps_usable and _cal(num_params=85_002).ps_usable
    rows = planner.plan_table(cal, [2, 4])
    assert rows and all(p.transport == "collective" for p in rows)
    straggly = _cal(num_params=85_002, spread=[1.0] * 5 + [3.0] * 5, **traffic_figures(cfg, 85_002))
    for n in (2, 8):  # never SSP or BSP over the PS, which the run would refuse with this codec
        assert planner.recommend(straggly, n, planner.Hardware("fast", 1e12, 1e-7)).transport == "collective"
