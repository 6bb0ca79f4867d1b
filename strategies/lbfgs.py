"""Sandblaster's batch optimiser, as pieces that need neither torch nor Ray.

- `ShardState`: what one parameter-server shard holds for Sandblaster: its slice of θ (float64 master
  copy), the open pass's accumulators with the record of portions already counted, and its slices of
  the L-BFGS history (s_i, y_i), the last gradient and the pending step. Every vector operation of the
  method is a method here and touches only this slice.
- `direction_coefficients`: the two-loop recursion (Nocedal & Wright, Algorithm 7.4) run on
  coefficients over the basis b = [s_0..s_{m-1}, y_0..y_{m-1}, g] (vector-free L-BFGS, Chen et al.,
  NIPS 2014). The only cross-shard input is the Gram matrix BᵀB, the sum of the shards' local Gram
  matrices: one round of scalars per direction instead of the plain recursion's 2m sequential dot
  products; each shard then forms d = Σ δ_j b_j from its own slices.
- `Armijo`: backtracking on the full-batch loss (t = 1 first, halved on failure), which needs a loss
  pass per trial and no gradient; strong Wolfe would need a gradient pass at every trial point.

Conventions: the objective is f(θ) = (1/|D|) Σ_i ℓ_i(θ) + (λ/2)‖θ‖² with λ = --weight-decay (0 when
unset), so the gradient is g = (1/|D|) Σ_i ∇ℓ_i + λθ. History vectors are float64; the workers compute
on float32 copies of θ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ARMIJO_C1 = 1e-4
CURVATURE_EPS = 1e-8  # a pair is stored only if yᵀs > ε‖y‖‖s‖ (keeps the implied H positive definite)


class ShardState:
    """One shard's slice of everything Sandblaster keeps (plain numpy, wrapped by the shard actor)."""

    def __init__(self, theta: np.ndarray, history: int, weight_decay: float = 0.0) -> None:
        self.theta = np.array(theta, dtype=np.float64, copy=True)
        self.history = history
        self.weight_decay = weight_decay
        self.s: list[np.ndarray] = []  # oldest first
        self.y: list[np.ndarray] = []
        self.grad: np.ndarray | None = None  # g at θ (after a gradient pass)
        self.prev_grad: np.ndarray | None = None  # g at the previous iterate, until y is formed
        self.step: np.ndarray | None = None  # s = θ_new − θ_old of the step just taken, until y is formed
        self.direction: np.ndarray | None = None
        self.trial: np.ndarray | None = None  # θ + t·d under evaluation by a loss pass
        self.open_pass(-1, "grad")

    # ------------------------------------------------------------------ passes
    def open_pass(self, pass_id: int, kind: str) -> None:
        """Start accumulating pass `pass_id` ("grad": gradient and loss at θ; "loss": loss at the trial)."""
        self.pass_id = pass_id
        self.kind = kind
        self.counted: set[int] = set()  # portions of this pass already added: each counts once
        self.acc = np.zeros_like(self.theta) if kind == "grad" else None
        self.loss_sum = 0.0
        self.count = 0

    def point(self, pass_id: int) -> np.ndarray | None:
        """θ (or the trial point) that pass `pass_id` is computed at, float32; None once it is closed."""
        if pass_id != self.pass_id:
            return None
        base = self.trial if self.kind == "loss" else self.theta
        assert base is not None
        return base.astype(np.float32)

    def add(self, pass_id: int, portion: int, grad: np.ndarray | None, loss_sum: float, count: int) -> bool:
        """Add one portion's summed gradient and loss; False for a copy already counted or a closed pass."""
        if pass_id != self.pass_id or portion in self.counted:
            return False
        self.counted.add(portion)
        if self.acc is not None:
            assert grad is not None, "a gradient pass needs the portion's gradient"
            self.acc += grad
        self.loss_sum += loss_sum
        self.count += count
        return True

    def reg(self, x: np.ndarray) -> float:
        """This slice's share of the L2 term (λ/2)‖x‖²."""
        return 0.5 * self.weight_decay * float(x @ x) if self.weight_decay else 0.0

    def close_grad(self) -> dict[str, float]:
        """g = acc/count + λθ; returns this slice's loss share and ‖g‖² (the coordinator sums them)."""
        assert self.acc is not None and self.count > 0
        self.grad = self.acc / self.count
        if self.weight_decay:
            self.grad += self.weight_decay * self.theta
        return {
            "loss_sum": self.loss_sum,
            "count": self.count,
            "reg": self.reg(self.theta),
            "gg": float(self.grad @ self.grad),
        }

    def close_loss(self) -> dict[str, float]:
        assert self.trial is not None and self.count > 0
        return {"loss_sum": self.loss_sum, "count": self.count, "reg": self.reg(self.trial)}

    # ------------------------------------------------------------------ the optimiser's vector work
    def form_pair(self) -> dict[str, float]:
        """y = g − g_prev for the pending step s; returns the local yᵀs, yᵀy, sᵀs for the skip rule."""
        if self.step is None or self.prev_grad is None or self.grad is None:
            return {}
        self.pending_y = self.grad - self.prev_grad
        s, y = self.step, self.pending_y
        return {"ys": float(y @ s), "yy": float(y @ y), "ss": float(s @ s)}

    def keep_pair(self, keep: bool) -> None:
        if keep:
            assert self.step is not None
            self.s.append(self.step)
            self.y.append(self.pending_y)
            if len(self.s) > self.history:
                self.s.pop(0)
                self.y.pop(0)
        self.step, self.prev_grad, self.pending_y = None, None, None

    def history_length(self) -> int:
        return len(self.s)

    def clear_history(self) -> None:
        self.s, self.y = [], []

    def basis(self) -> list[np.ndarray]:
        assert self.grad is not None
        return [*self.s, *self.y, self.grad]

    def gram(self) -> np.ndarray:
        """This slice's BᵀB over b = [s..., y..., g]."""
        b = np.stack(self.basis())
        return b @ b.T

    def set_direction(self, coefficients: np.ndarray) -> None:
        """d = Σ_j δ_j b_j, from the coefficients the coordinator computed (d = −H g)."""
        self.direction = np.asarray(coefficients, dtype=np.float64) @ np.stack(self.basis())

    def set_trial(self, t: float) -> None:
        assert self.direction is not None
        self.trial = self.theta + t * self.direction

    def accept(self, t: float) -> None:
        """θ ← θ + t·d; the step s and g (as g_prev) wait for the next gradient to form y."""
        assert self.direction is not None
        self.step = t * self.direction
        self.theta = self.theta + self.step
        self.prev_grad = self.grad
        self.trial = None

    def reject(self) -> None:
        """No step (the line search ran out of trials): θ stays, the history starts over."""
        self.trial, self.step, self.prev_grad = None, None, None
        self.clear_history()

    def gd_step(self, lr: float) -> None:
        assert self.grad is not None
        self.theta = self.theta - lr * self.grad

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        return {
            "theta": self.theta.copy(),
            "s": [v.copy() for v in self.s],
            "y": [v.copy() for v in self.y],
            "prev_grad": None if self.prev_grad is None else self.prev_grad.copy(),
            "step": None if self.step is None else self.step.copy(),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.theta = np.array(state["theta"], dtype=np.float64, copy=True)
        self.s = [np.array(v, dtype=np.float64) for v in state["s"]]
        self.y = [np.array(v, dtype=np.float64) for v in state["y"]]
        self.prev_grad = None if state["prev_grad"] is None else np.array(state["prev_grad"], dtype=np.float64)
        self.step = None if state["step"] is None else np.array(state["step"], dtype=np.float64)


def keep_pair(ys: float, yy: float, ss: float, eps: float = CURVATURE_EPS) -> bool:
    """The skip rule: store (s, y) only with enough positive curvature."""
    return ys > eps * math.sqrt(yy * ss)


def direction_coefficients(gram: np.ndarray, m: int) -> np.ndarray:
    """δ with d = Σ δ_j b_j = −H·g, b = [s_0..s_{m-1}, y_0..y_{m-1}, g] (oldest first), from BᵀB alone.

    The two-loop recursion with every vector a combination of the basis: q = g is the unit vector of
    g's column, a dot product qᵀb_j is (δᵀ BᵀB)_j, and q −= α y_i is a change of one coefficient.
    """
    n = 2 * m + 1
    delta = np.zeros(n)
    delta[2 * m] = 1.0  # q = g
    if m == 0:
        return -delta  # steepest descent
    s_, y_ = (lambda i: i), (lambda i: m + i)
    rho = [1.0 / gram[y_(i), s_(i)] for i in range(m)]
    alpha = [0.0] * m
    for i in reversed(range(m)):  # newest to oldest
        alpha[i] = rho[i] * float(delta @ gram[:, s_(i)])
        delta[y_(i)] -= alpha[i]
    gamma = gram[s_(m - 1), y_(m - 1)] / gram[y_(m - 1), y_(m - 1)]
    delta *= gamma
    for i in range(m):  # oldest to newest
        beta = rho[i] * float(delta @ gram[:, y_(i)])
        delta[s_(i)] += alpha[i] - beta
    return -delta


@dataclass
class Armijo:
    """Backtracking: accept t when f(θ + t·d) ≤ f(θ) + c₁·t·gᵀd, else halve t (at most `trials` times)."""

    f0: float
    slope: float  # gᵀd < 0
    t: float = 1.0
    trials: int = 20
    c1: float = ARMIJO_C1
    evaluations: int = 0
    tried: list[float] = field(default_factory=list)

    def judge(self, f_t: float) -> str:
        """After the loss at the current t: "accept", "retry" (t halved) or "give_up"."""
        self.evaluations += 1
        self.tried.append(self.t)
        if math.isfinite(f_t) and f_t <= self.f0 + self.c1 * self.t * self.slope:
            return "accept"
        if self.evaluations >= self.trials:
            return "give_up"
        self.t *= 0.5
        return "retry"
