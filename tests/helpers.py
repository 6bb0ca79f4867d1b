"""Small helpers shared by the tests that start real runs."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import torch

from distrain.orchestrator.callbacks import Callback
from distrain.orchestrator.checkpoint import load_checkpoint, whole_checkpoint
from distrain.trainers.task import ClassificationTask


def steps_of(run_dir, sort_by: tuple[str, ...] | None = ("step", "worker")) -> pd.DataFrame:
    """A run's step rows from its metrics.parquet, in `sort_by` order (None: as recorded)."""
    df = pd.read_parquet(Path(run_dir) / "metrics.parquet")
    steps = df[df["kind"] == "step"]
    return steps.sort_values(list(sort_by)) if sort_by else steps


def final_params(run_dir: Path) -> torch.Tensor:
    """The final model parameters of a run, flattened in the model's parameter order (a sharded run's
    checkpoint put together from its shards)."""
    path = Path(run_dir) / "checkpoints" / "final.pt"
    state = whole_checkpoint(load_checkpoint(path), path)["model"]
    return torch.cat([t.reshape(-1).double() for t in state.values()])


CHECKPOINT_KEYS = {"format", "version", "strategy", "model_name", "config", "epoch", "global_step"} | {
    "failures", "elapsed_s", "model", "optimizer", "ps", "channel",
}  # fmt: skip


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts and lists (a checkpoint's codec state)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return [t for item in items for t in tensors_in(item)]


def assert_compact_checkpoint(path: Path) -> dict:
    """A checkpoint is parameters + optimizer state + small metadata (issue 13): no metrics rows (they
    grew with the step count), and on disk no bigger than its tensors plus a little."""
    payload = load_checkpoint(Path(path))
    assert set(payload) <= CHECKPOINT_KEYS, set(payload) - CHECKPOINT_KEYS
    tensors = [*payload["model"].values(), *payload["optimizer"]["vectors"].values()]
    tensors += tensors_in(payload.get("channel"))  # each rank's residuals under a codec
    size = sum(t.numel() * t.element_size() for t in tensors)
    assert Path(path).stat().st_size < size + 64 * 1024, (Path(path).stat().st_size, size)
    return payload


def run_two_rank_script(tmp_path: Path, name: str, script: str) -> None:
    """Run `script` (which spawns two ranks that join through the port given as argv[1] and prints
    "OK" when both pass) in a fresh interpreter, and fail with its stderr if it did not pass."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / name
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path), str(port)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


class LoudDigits(ClassificationTask):
    """The bundled digits mlp with a loss 1e4 times larger: fp16's starting scale 2**16 overflows its
    backward for several steps. Each step logs the sum of this worker's parameter pieces before it
    (`train_param_sum`): a replica's worker d and the other replica's worker d hold the same piece."""

    def __init__(self):
        super().__init__(model="mlp")

    def criterion(self, output, batch):
        return super().criterion(output, batch) * 1e4

    def loss(self, model, batch):
        from distrain.trainers.sharded_trainer import local_part

        held = float(sum(local_part(p.detach()).double().sum() for p in model.parameters()))
        return super().loss(model, batch), {"param_sum": held}


class BlockStarts:
    """`on_rows` comes once per worker a block (collective strategies): `first(rows)` says whether this call
    is its block's first (a worker's rows coming again start a new block); `blocks` counts the blocks before."""

    def __init__(self) -> None:
        self.block: set = set()
        self.blocks = 0

    def first(self, rows) -> bool:
        worker = rows["worker"][0] if rows["worker"] else None
        if worker in self.block:
            self.block, self.blocks = set(), self.blocks + 1
        first = not self.block
        self.block.add(worker)
        return first


class PaceUntilRejoined(Callback):
    """Blocks run faster than a replica's workers are built: until a worker of `ranks` has trained before step
    `at` (a --chaos kill's) and again after it (its slot rejoined), slow the driver between blocks, `before_s`
    until the first and `pause_s` until the second, so the kill finds it a member and its replacement joins
    before the run ends.

    The first call of each block after the first (`BlockStarts`) decides, on the rows of the blocks before it,
    and sleeps once. (Sleeping on every call while the rows had not shown the awaited worker paid the pause
    once per worker, also in the blocks that had it, for the workers whose rows came before its own.)"""

    def __init__(self, ranks, at: int, pause_s: float, before_s: float | None = None) -> None:
        self.ranks, self.at, self.pause_s = set(ranks), at, pause_s
        self.before_s = pause_s if before_s is None else before_s
        self.latest, self.before, self.after, self.starts = 0, False, False, BlockStarts()

    def on_rows(self, rows):
        if self.starts.first(rows) and self.starts.blocks:
            if not self.before:
                time.sleep(self.before_s)
            elif self.latest >= self.at - 1 and not self.after:  # rows to step at - 1: the kill has fired
                time.sleep(self.pause_s)
        self.latest = max([self.latest, *rows["step"]])
        mine = [step for w, step in zip(rows["worker"], rows["step"], strict=True) if w in self.ranks]
        self.before = self.before or any(step < self.at for step in mine)
        self.after = self.after or any(step >= self.at for step in mine)
