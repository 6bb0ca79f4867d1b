"""The planner's analytic model (planning/planner.py): its identities, checked against direct counts
and real tensors; the straggler order statistics against simulation; the recommendation's rules."""

from __future__ import annotations

import random

import pytest
import torch

from distrain.config import RunConfig
from distrain.orchestrator import memory
from distrain.planning import planner
from distrain.planning.planner import Calibration, Hardware


def _cal(**changes) -> Calibration:
    base = dict(
        task="cnn on digits", batch_size=32, num_params=100_000, compute_s=0.01, effective_cores=2.0,
        spread=[1.0] * 10, allreduce_latency_s=1e-4, allreduce_bandwidth=1e9, sync_scale=1.0,
        ps_call_s=2e-3, ps_bandwidth=1e9, ps_apply_s=5e-4, memory_per_worker=500 * 2**20,
        memory_per_shard=480 * 2**20,
    )  # fmt: skip
    return Calibration(**(base | changes))


def test_ring_all_reduce_moves_2_p_minus_1_over_p_of_the_buffer_per_worker():
    n = 4_000_000
    for p in (2, 3, 4, 8, 64):
        # simulate the ring: reduce-scatter then all-gather, P-1 steps each, one chunk of n/P per step
        sent = sum(n / p for _ in range(p - 1)) + sum(n / p for _ in range(p - 1))
        assert planner.ring_bytes_per_worker(n, p) == pytest.approx(sent)
        assert planner.ring_rounds(p) == 2 * (p - 1)
    assert planner.ring_bytes_per_worker(n, 1) == 0
    # time = rounds x alpha + bytes / beta
    assert planner.allreduce_time(n, 4, 1e-3, 1e8) == pytest.approx(6e-3 + 1.5 * n / 1e8)
    # the tree has fewer rounds, the same bandwidth term
    assert planner.allreduce_time(n, 64, 1e-3, 1e8, "tree") < planner.allreduce_time(n, 64, 1e-3, 1e8)
    assert planner.tree_rounds(64) == 12


def test_parameter_server_shard_load_and_naive_root():
    n = 1000
    # P workers each push n bytes split evenly over K shards: one shard receives P n / K
    p, k = 8, 4
    per_shard = [0.0] * k
    for _ in range(p):
        for shard in range(k):
            per_shard[shard] += n / k
    assert all(planner.ps_shard_bytes(n, p, k) == pytest.approx(x) for x in per_shard)
    assert planner.naive_root_bytes(n, p) == 2 * (p - 1) * n
    pred = planner.predict(_cal(), "async", "ps", 8)
    assert pred.fan_in == 8 and pred.bytes_per_worker == _cal().grad_bytes


def test_bubble_fraction_matches_a_simulated_gpipe_schedule():
    for s, m in ((2, 1), (2, 8), (4, 4), (4, 16)):
        # GPipe: forwards of micro-batch j at stage i run in slot i + j; the forward pass lasts m + s - 1 slots
        slots = m + s - 1
        busy = s * m
        assert planner.bubble_fraction(s, m) == pytest.approx(1 - busy / (s * slots))


def test_expected_order_statistics_match_a_simulation():
    rng = random.Random(0)
    spread = [1.0] * 8 + [1.5, 3.0]
    for n, b in ((2, 0), (4, 0), (4, 1), (8, 2)):
        draws = [sorted(rng.choice(spread) for _ in range(n + b))[n - 1] for _ in range(20_000)]
        assert planner.expected_order_stat(spread, n, n + b) == pytest.approx(sum(draws) / len(draws), rel=0.03)
    assert planner.expected_max(spread, 1) == pytest.approx(sum(spread) / len(spread))
    costs = planner.straggler_costs(_cal(spread=spread), 8, backups=2, bound=2)
    assert costs["bsp"] > costs["ssp_s2"] > 1.0 and costs["k_of_n_b2"] < costs["bsp"]


def test_memory_sums_equal_the_real_tensors_of_a_trained_model():
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import MODELS

    info = DATASETS.get("digits").info
    torch.manual_seed(0)
    net = MODELS.get("cnn")(info)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(32, info.channels, info.height, info.width)
    outputs = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: outputs.append(o.numel()))
        for m in net.modules()
        if not list(m.children())
    ]
    loss = net(x).sum()
    for h in hooks:
        h.remove()
    loss.backward()
    opt.step()
    n = sum(p.numel() for p in net.parameters())
    held = sum(p.numel() * p.element_size() for p in net.parameters())
    held += sum(p.grad.numel() * p.grad.element_size() for p in net.parameters())
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    est = memory.estimate(RunConfig(model="cnn", dataset="digits", batch_size=32), n)
    # the estimate's model part is θ, gradients, momentum (the real tensors) plus one communication buffer
    assert est.model == held + n * 4
    # activations: the layer outputs of a real forward pass, plus the input, twice (their gradients)
    assert est.activations == 2 * 4 * (sum(outputs) + x.numel())


def test_contention_stretches_compute_past_the_effective_cores():
    cal = _cal(effective_cores=2.0)
    steps = {n: planner.predict(cal, "bsp", "collective", n).compute_s for n in (1, 2, 4, 8)}
    assert steps[1] == steps[2] == pytest.approx(0.01)
    assert steps[4] == pytest.approx(0.02) and steps[8] == pytest.approx(0.04)
    # other load on the machine: measured as a slope, each further worker adds its share to every step
    loaded = _cal(effective_cores=16.0, contention_slope=0.5)
    assert planner.predict(loaded, "bsp", "collective", 3).compute_s == pytest.approx(0.02)
    assert planner.predict(loaded, "bsp", "collective", 1).compute_s == pytest.approx(0.01)
    # a what-if machine (one worker per machine) does not time-share
    hw = Hardware("x", 1e9, 1e-5)
    assert planner.predict(cal, "bsp", "collective", 8, hw).compute_s == pytest.approx(0.01)


def test_local_sgd_and_diloco_amortise_the_all_reduce_and_tau_one_is_bsp_traffic():
    cal = _cal(optimizer_copies=0, sync_scale=1.0)
    bsp = planner.predict(cal, "bsp", "collective", 4)
    one = planner.predict(cal, "local-sgd", "collective", 4, settings={"tau": 1})
    eight = planner.predict(cal, "local-sgd", "collective", 4, settings={"tau": 8})
    assert one.bytes_per_worker == bsp.bytes_per_worker and one.comm_s == pytest.approx(bsp.comm_s)
    assert eight.bytes_per_worker == pytest.approx(bsp.bytes_per_worker / 8)
    dl = planner.predict(cal, "diloco", "collective", 4, settings={"sync_every": 50})
    assert dl.bytes_per_worker == pytest.approx(bsp.bytes_per_worker / 50)
    assert dl.memory_per_worker == cal.memory_per_worker + 2 * cal.grad_bytes


def test_the_planner_plans_each_strategy_at_the_settings_distrain_run_defaults_to():
    """`distrain plan`'s table models ssp, local SGD and DiLoCo as `distrain run --strategy S` runs them
    by default (DiLoCo's --sync-every was planned at 50 while a run takes 8)."""
    flags = {"ssp": "staleness", "local-sgd": "tau", "diloco": "sync_every"}
    planned = {p.strategy: p.setting for p in planner.plan_table(_cal(), [4])}
    for strategy, field in flags.items():
        run_default = getattr(RunConfig(strategy=strategy).options_of(strategy), field)
        assert planned[strategy] == f"--{field.replace('_', '-')} {run_default}", strategy
    default = planner.predict(_cal(optimizer_copies=0), "diloco", "collective", 4)
    same = planner.predict(_cal(optimizer_copies=0), "diloco", "collective", 4, settings={"sync_every": 8})
    assert default.bytes_per_worker == pytest.approx(same.bytes_per_worker)  # traffic amortised over H = 8


def test_recommendation_follows_the_link():
    fast = Hardware("fast", 1e12, 1e-7)
    slow = Hardware("slow", 1e6, 1e-3)
    cal = _cal(num_params=1_000_000, compute_s=0.05)
    assert planner.recommend(cal, 8, fast).strategy == "bsp"
    slow_pick = planner.recommend(cal, 8, slow)
    assert slow_pick.strategy in ("local-sgd", "diloco") and "BSP step" in slow_pick.reason
    # big stragglers on a fast link: bound the staleness instead
    straggly = _cal(num_params=1000, compute_s=0.05, spread=[1.0] * 5 + [3.0] * 5)
    assert planner.recommend(straggly, 8, fast).strategy == "ssp"
    assert planner.recommend(cal, 1).strategy == "bsp"
