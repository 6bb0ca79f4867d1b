"""Sandblaster's algorithm without Ray: the shards' state (strategies/lbfgs.py) driven by the real
coordinator (strategies/sandblaster_coordinator.py) over in-process shards, with simulated workers.

The identities: the full-batch gradient assembled from portions (copies, a lost worker) is the
one-process gradient; the sharded, vector-free two-loop recursion gives the plain recursion's direction
for 1, 2 and 3 shards; gd is plain full-batch gradient descent step for step; L-BFGS reaches the optimum
scipy finds for the same L2-regularised logistic regression, in far fewer passes than GD.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest
import torch

from distrain.strategies.lbfgs import Armijo, ShardState, direction_coefficients
from distrain.strategies.partition import partition
from distrain.strategies.sandblaster_coordinator import LocalShards, SandblasterCoordinator

LAMBDA = 1e-2  # --weight-decay: the L2 term (λ/2)‖θ‖² of the objective


def plain_two_loop(g: np.ndarray, s: list[np.ndarray], y: list[np.ndarray]) -> np.ndarray:
    """Nocedal & Wright Algorithm 7.4, one process, vectors (oldest pair first)."""
    q = g.copy()
    alpha = []
    for si, yi in zip(reversed(s), reversed(y), strict=True):
        a = (si @ q) / (yi @ si)
        alpha.append(a)
        q -= a * yi
    r = (s[-1] @ y[-1]) / (y[-1] @ y[-1]) * q
    for (si, yi), a in zip(zip(s, y, strict=True), reversed(alpha), strict=True):
        b = (yi @ r) / (yi @ si)
        r += si * (a - b)
    return -r


@pytest.mark.parametrize("num_shards", [1, 2, 3])
def test_sharded_two_loop_equals_plain_two_loop(num_shards: int) -> None:
    rng = np.random.default_rng(num_shards)
    n, m = 23, 5
    a = rng.normal(size=(n, n))
    hessian = a @ a.T + n * np.eye(n)  # pairs from a convex quadratic: yᵀs > 0
    s = [rng.normal(size=n) for _ in range(m)]
    y = [hessian @ si for si in s]
    g = rng.normal(size=n)
    expected = plain_two_loop(g, s, y)

    shards = []
    for start, stop in partition(n, num_shards):
        shard = ShardState(np.zeros(stop - start), history=m)
        shard.s, shard.y, shard.grad = [v[start:stop] for v in s], [v[start:stop] for v in y], g[start:stop]
        shards.append(shard)
    gram = sum(shard.gram() for shard in shards)  # the only cross-shard values: scalars
    delta = direction_coefficients(gram, m)
    for shard in shards:
        shard.set_direction(delta)
    got = np.concatenate([shard.direction for shard in shards])
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    assert not np.allclose(got, -g)  # the history did change the direction


def test_two_loop_without_history_is_steepest_descent() -> None:
    shard = ShardState(np.zeros(4), history=3)
    shard.grad = np.array([1.0, -2.0, 0.5, 3.0])
    shard.set_direction(direction_coefficients(shard.gram(), 0))
    np.testing.assert_array_equal(shard.direction, -shard.grad)


def test_armijo_halves_until_sufficient_decrease() -> None:
    f = lambda t: (t - 0.1) ** 2  # noqa: E731 - f(0) = 0.01, slope at 0 = -0.2
    search = Armijo(f0=f(0.0), slope=-0.2)
    verdicts = []
    while (v := search.judge(f(search.t))) == "retry":
        verdicts.append(search.t)
    assert v == "accept" and search.evaluations == len(verdicts) + 1
    assert search.tried == [1.0, 0.5, 0.25, 0.125][: search.evaluations]
    assert f(search.t) <= f(0.0) + 1e-4 * search.t * -0.2
    assert f(search.t * 2) > f(0.0) + 1e-4 * search.t * 2 * -0.2  # the previous trial failed


def test_pairs_without_curvature_are_skipped() -> None:
    shard = ShardState(np.zeros(2), history=2)
    shard.grad, shard.prev_grad, shard.step = np.array([1.0, 0.0]), np.array([2.0, 0.0]), np.array([1.0, 0.0])
    from distrain.strategies.lbfgs import keep_pair

    dots = shard.form_pair()  # y = (-1, 0), s = (1, 0): yᵀs < 0
    assert not keep_pair(dots["ys"], dots["yy"], dots["ss"])
    shard.keep_pair(False)
    assert shard.history_length() == 0


# ---------------------------------------------------------------- a convex task: logistic regression on digits
@functools.cache
def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = ((d.data.astype(np.float32) - 4.88) / 6.02)[:400]
    return x, d.target[:400].astype(np.int64)


def model_loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    w, b = theta[: 64 * 10].view(10, 64), theta[64 * 10 :]
    return torch.nn.functional.cross_entropy(x @ w.T + b, y, reduction=reduction)


def full_batch(theta: np.ndarray) -> tuple[float, np.ndarray]:
    """The objective f = mean loss + (λ/2)‖θ‖² and its gradient, in one process (float64)."""
    x, y = digits()
    t = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
    f = model_loss(t, torch.tensor(x, dtype=torch.float64), torch.tensor(y)) + 0.5 * LAMBDA * (t @ t)
    f.backward()
    return float(f.detach()), t.grad.numpy()


def initial_theta() -> np.ndarray:
    return np.random.default_rng(0).normal(scale=0.01, size=650).astype(np.float32)


def portion_sums(theta32: np.ndarray, portion: int, portions: int, kind: str) -> tuple[np.ndarray | None, float, int]:
    """What a worker computes: summed loss (and gradient) over one portion at float32 θ."""
    x, y = digits()
    n = len(x)
    lo, hi = portion * n // portions, (portion + 1) * n // portions
    t = torch.tensor(theta32, requires_grad=kind == "grad")
    loss = model_loss(t, torch.tensor(x[lo:hi]), torch.tensor(y[lo:hi]), "sum")
    if kind == "grad":
        loss.backward()
        return t.grad.numpy(), float(loss.detach()), hi - lo
    return None, float(loss), hi - lo


class Workers:
    """Simulated workers calling the coordinator and the shards as strategies/sandblaster.py does."""

    def __init__(self, num_shards: int, method: str, portions: int, backup: bool = False, lr: float = 0.5) -> None:
        theta = initial_theta()
        self.bounds = partition(len(theta), num_shards)
        self.states = [ShardState(theta[a:b], history=10, weight_decay=LAMBDA) for a, b in self.bounds]
        self.coordinator = SandblasterCoordinator(LocalShards(self.states), method, portions, backup, lr)

    def theta(self) -> np.ndarray:
        return np.concatenate([s.theta for s in self.states])

    def grad(self) -> np.ndarray:
        return np.concatenate([s.grad for s in self.states])

    async def take(self, worker: int, upto: int):  # noqa: ANN201
        return await asyncio.wait_for(self.coordinator.acquire(worker, None, upto), 5)

    async def work(self, task) -> bool:  # noqa: ANN001
        """Compute and add one portion into every shard, then report it; True if this copy counted."""
        points = [s.point(task.pass_id) for s in self.states]
        if any(p is None for p in points):
            return False
        grad, loss_sum, count = portion_sums(np.concatenate(points), task.portion, task.of, task.kind)
        counted = [
            s.add(task.pass_id, task.portion, None if grad is None else grad[a:b], loss_sum, count)
            for s, (a, b) in zip(self.states, self.bounds, strict=True)
        ]
        await self.coordinator.complete(task.pass_id, task.portion, task.copy, counted[0])
        await asyncio.sleep(0)  # let a closing pass run
        return counted[0]

    async def run(self, iterations: int) -> list[dict]:
        """One worker doing every portion, iteration after iteration; the records per iteration."""
        await self.coordinator.start()
        for k in range(iterations):
            while (task := await self.take(0, k)) is not None:
                await self.work(task)
            await self.coordinator.wait_iteration(k)
        return [self.coordinator.records[k] for k in range(iterations)]


def test_gradient_from_portions_with_copies_and_a_lost_worker_is_the_full_batch_gradient() -> None:
    async def scenario() -> Workers:
        w = Workers(num_shards=3, method="gd", portions=7, backup=True)
        await w.coordinator.start()
        lost = await w.take(1, 0)  # worker 1 takes portion 0 and dies with it
        slow = await w.take(2, 0)  # worker 2 takes portion 1 and is slow
        others = [await w.take(0, 0) for _ in range(5)]  # worker 0 takes the rest
        assert {t.portion for t in others} == {2, 3, 4, 5, 6} and not any(t.copy for t in others)
        for t in others:
            assert await w.work(t)
        assert await w.coordinator.worker_lost(1) == 1  # worker 1's portion goes back to the queue
        again = await w.take(0, 0)
        assert (again.portion, again.copy) == (lost.portion, False)
        assert await w.work(again)
        copy = await w.take(0, 0)  # nothing unassigned: a backup copy of the slow worker's portion
        assert (copy.portion, copy.copy) == (slow.portion, True)
        assert await w.work(copy)  # the copy arrives first and counts
        assert not await w.work(slow)  # the slow original arrives late: not added a second time
        assert await w.take(0, 0) is None  # the pass closed: iteration 0 is over (gd: one pass)
        await w.coordinator.wait_iteration(0)
        return w

    w = asyncio.run(scenario())
    _, expected = full_batch(initial_theta().astype(np.float64))
    np.testing.assert_allclose(w.grad(), expected, rtol=1e-5, atol=1e-6)
    record = w.coordinator.records[0]
    assert record["portions_reissued"] == 2 and record["backups_used"] == 1
    assert record["iteration_passes"] == 1


def test_gd_is_plain_full_batch_gradient_descent_step_for_step() -> None:
    lr, steps = 0.5, 6
    w = Workers(num_shards=2, method="gd", portions=5, lr=lr)
    records = asyncio.run(w.run(steps))
    theta = initial_theta().astype(np.float64)
    for k in range(steps):
        f, g = full_batch(theta)
        assert records[k]["loss"] == pytest.approx(f, rel=1e-6)
        assert records[k]["grad_norm"] == pytest.approx(np.linalg.norm(g), rel=1e-5)
        theta = theta - lr * g
    np.testing.assert_allclose(w.theta(), theta, rtol=1e-5, atol=1e-6)
    assert [r["data_passes"] for r in records] == list(range(1, steps + 1))


def numpy_objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
    """The same objective written again in numpy (float64), independent of torch, for scipy."""
    x, y = digits()
    x = x.astype(np.float64)
    w, b = theta[: 64 * 10].reshape(10, 64), theta[64 * 10 :]
    z = x @ w.T + b
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    f = -np.log(p[np.arange(n), y]).mean() + 0.5 * LAMBDA * theta @ theta
    p[np.arange(n), y] -= 1
    gz = p / n
    grad = np.concatenate([(gz.T @ x).ravel(), gz.sum(axis=0)]) + LAMBDA * theta
    return float(f), grad


def scipy_optimum() -> float:
    from scipy.optimize import minimize

    options = {"gtol": 1e-10, "ftol": 1e-15, "maxiter": 5000}
    result = minimize(numpy_objective, np.zeros(650), jac=True, method="L-BFGS-B", options=options)
    assert np.linalg.norm(result.jac) < 1e-6
    return float(result.fun)


def test_lbfgs_reaches_the_optimum_in_far_fewer_passes_than_gd() -> None:
    optimum = scipy_optimum()
    lbfgs = asyncio.run(Workers(num_shards=2, method="lbfgs", portions=4).run(60))
    reached = [r for r in lbfgs if r["loss"] <= optimum * (1 + 1e-4)]
    assert reached, f"L-BFGS ended at {lbfgs[-1]['loss']}, optimum {optimum}"
    lbfgs_passes = reached[0]["data_passes"]
    gd = asyncio.run(Workers(num_shards=2, method="gd", portions=4, lr=1.0).run(3 * lbfgs_passes))
    assert gd[-1]["loss"] > optimum * (1 + 1e-4), "GD with 3x the passes should not be there yet"
    assert all(r["step_length"] > 0 for r in reached[:1])
    assert max(r["line_search_evals"] for r in lbfgs) >= 1
