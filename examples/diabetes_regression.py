"""MSE regression on scikit-learn's bundled diabetes data (442 patients, 10 features).

Features and target are standardised with the training split's statistics; the test split is a fixed
fifth, and --val-fraction of the rest is the validation split. Reported on each: the loss (MSE in
standardised units), MAE in the target's own units, and R² (computed from the reduced sums, so it is
exact over the whole split, not a mean of per-batch R²s).

    distrain run --task examples/diabetes_regression.py:Diabetes --epochs 30 --batch-size 16
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distrain


class Diabetes(distrain.Task):
    default_target = "val_r2>=0.4"
    carve_validation = True  # --val-fraction of the training split is the validation split

    def __init__(self, hidden: int = 32, seed: int = 0):
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        order = np.random.default_rng(seed).permutation(len(y))
        n_test = len(y) // 5
        test, train = order[:n_test], order[n_test:]
        mean, std = x[train].mean(0), x[train].std(0)
        self.y_mean, self.y_std = float(y[train].mean()), float(y[train].std())
        xs = torch.tensor((x - mean) / std, dtype=torch.float32)
        ys = torch.tensor((y - self.y_mean) / self.y_std, dtype=torch.float32)
        self.train = TensorDataset(xs[train], ys[train])
        self.test = TensorDataset(xs[test], ys[test])
        self.hidden = hidden

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(10, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1))

    def datasets(self):
        return self.train, self.test

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.mse_loss(model(x).squeeze(-1), y)

    def metrics(self, model, batch):
        x, y = batch
        err = model(x).squeeze(-1) - y
        # the target's first two moments, summed, so that R² is exact over each evaluated split
        n = float(len(y))
        return {"mae": float(err.abs().mean()) * self.y_std, "y": (float(y.sum()), n), "y2": (float((y * y).sum()), n)}

    def derived_metrics(self, means):
        # R² = 1 - MSE / Var(y) over the whole split (the loss is its MSE, reduced by sample).
        return {"r2": 1.0 - means["loss"] / (means["y2"] - means["y"] ** 2)}
