"""--balance speed's decisions (orchestrator/balance.py) on plain step times."""

from __future__ import annotations

import numpy as np

from distrain.orchestrator.balance import ShareBalancer, step_time


def feed(balancer: ShareBalancer, per_sample: list[float], rows: int, rng=None, noise: float = 0.0) -> None:
    """`rows` steps of every worker at its current share, each taking share x seconds-per-sample (x noise)."""
    for _ in range(rows):
        for w, s in enumerate(per_sample):
            jitter = 1.0 + (rng.uniform(-noise, noise) if rng is not None else 0.0)
            balancer.add([w], [balancer.current[w] * s * jitter], [balancer.current[w]])


def test_a_worker_three_times_slower_gets_a_quarter_of_the_batch_and_the_step_gets_faster():
    balancer = ShareBalancer(workers=2, global_batch=64)
    assert balancer.shares_for(0) == (32, 32)  # nothing measured yet: equal
    feed(balancer, [0.001, 0.003], rows=9)
    assert balancer.shares_for(10) == (32, 32)  # too few rows to judge
    feed(balancer, [0.001, 0.003], rows=1)
    assert balancer.shares_for(20) == (48, 16)
    assert step_time((48, 16), [0.001, 0.003]) < step_time((32, 32), [0.001, 0.003]) / 1.4
    assert balancer.moves == [{"step": 20, "shares": [48, 16]}]
    feed(balancer, [0.001, 0.003], rows=20)
    assert balancer.shares_for(30) == (48, 16)  # measured at its new share, the same speed: it stays


def test_every_worker_gets_the_same_shares_for_a_step_whatever_was_measured_in_between():
    balancer = ShareBalancer(workers=2, global_batch=64)
    feed(balancer, [0.001, 0.001], rows=10)
    first = balancer.shares_for(10)  # worker 0 dealt the segment at step 10 ...
    feed(balancer, [0.001, 0.004], rows=20)
    assert balancer.shares_for(10) == first  # ... worker 1 dealt it later: the same cut
    assert balancer.shares_for(20) != first


def test_equal_workers_with_noisy_times_keep_their_shares_within_ten_percent_of_equal():
    """Step times jittered by up to +-40 % (a loaded machine); 20 runs of 60 segments each."""
    for seed in range(20):
        rng = np.random.default_rng(seed)
        balancer = ShareBalancer(workers=4, global_batch=128)
        for segment in range(60):
            feed(balancer, [0.002] * 4, rows=5, rng=rng, noise=0.4)
            shares = balancer.shares_for(5 * segment)
            assert max(abs(b - 32) for b in shares) <= 3.2, (seed, shares)
        assert len(balancer.moves) <= 1, balancer.moves  # no thrashing


def test_a_slow_worker_is_still_found_through_the_noise():
    rng = np.random.default_rng(1)
    balancer = ShareBalancer(workers=2, global_batch=64)
    for segment in range(6):
        feed(balancer, [0.001, 0.003], rows=5, rng=rng, noise=0.4)
        balancer.shares_for(5 * segment)
    assert balancer.current[1] < 20 and len(balancer.moves) == 1


def test_static_weights_are_the_starting_point_and_a_changed_speed_moves_them():
    balancer = ShareBalancer(workers=2, global_batch=64, initial=(48, 16))
    feed(balancer, [0.001, 0.003], rows=10)
    assert balancer.shares_for(0) == (48, 16)
    feed(balancer, [0.001, 0.001], rows=20)  # the slow worker got fast (its window is all new rows)
    assert balancer.shares_for(5) == (32, 32)
    assert balancer.summary() == {"final_shares": [32, 32], "moves": [{"step": 5, "shares": [32, 32]}]}
