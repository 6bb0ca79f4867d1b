"""Deterministic per-epoch data order and its split across workers.

Epoch e visits the training set in the order of a permutation drawn from (seed, e). Global step k of
the epoch takes the next `global_batch` indices of that order; worker r of N takes the r-th of N equal
contiguous slices, or, given heterogeneous workers' shares (trainers/shares.py), the r-th of N unequal
contiguous blocks (a cut replica's block cut again into equal parts for its data-parallel ranks). So N
workers see, step for step, exactly the samples one worker at the global batch sees, which is what makes
BSP over N workers equal to one large-batch worker. The incomplete last global batch of an epoch is
dropped, so every step has the same global batch size.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from distrain.errors import ConfigError
from distrain.trainers.shares import share_bounds


class EpochSharder:
    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if global_batch > num_samples:
            raise ConfigError(
                f"global batch {global_batch} exceeds the {num_samples} training samples; "
                "lower --batch-size or --workers"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @lru_cache(maxsize=2)  # noqa: B019 - a sharder lives as long as its worker; two epochs are plenty
    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch_indices(self, epoch: int, step: int) -> np.ndarray:
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        start = step * self.global_batch
        return self.order(epoch)[start : start + self.global_batch]

    def worker_indices(
        self,
        epoch: int,
        step: int,
        rank: int,
        world_size: int,
        shares: tuple[int, ...] | None = None,
        cut: int = 1,
    ) -> np.ndarray:
        """Worker `rank`'s samples of a step: the r-th equal slice, or its part of `shares` (summing to the
        global batch): one count per `cut` consecutive workers (a replica's data-parallel ranks), whose
        contiguous block is cut into `cut` equal parts, part rank % cut of block rank // cut."""
        if shares is not None:
            if len(shares) * cut != world_size or sum(shares) != self.global_batch:
                raise ValueError(f"shares {shares} do not cut a global batch of {self.global_batch} in {world_size}")
            block, part = divmod(rank, cut)
            start, stop = share_bounds(shares, block)
            if (stop - start) % cut:
                raise ValueError(f"a share of {stop - start} does not split into {cut} equal parts")
            size = (stop - start) // cut
            return self.global_batch_indices(epoch, step)[start + part * size : start + (part + 1) * size]
        if self.global_batch % world_size:
            raise ValueError(f"global batch {self.global_batch} does not split into {world_size} equal parts")
        per_worker = self.global_batch // world_size
        batch = self.global_batch_indices(epoch, step)
        return batch[rank * per_worker : (rank + 1) * per_worker]
