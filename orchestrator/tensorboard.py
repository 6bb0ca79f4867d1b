"""`--tensorboard DIR`: a callback that writes a run's figures as TensorBoard event files.

Built on tensorboardX, not torch.utils.tensorboard: tensorboardX comes with ray[tune] (a dependency
already) and needs only protobuf, whereas torch.utils.tensorboard imports the `tensorboard` package
(the server, with grpc, werkzeug, markdown) just to write a file. `tensorboard --logdir DIR` reads
either's files.

Written under DIR/<run id>/ (several runs with one DIR compare side by side), x axis = global steps
completed:
    train/loss            mean over the step's worker rows (every worker's slice of the global batch)
    train/lr              the step's learning rate
    train/samples_per_s   the steady-state figure over the rows so far (orchestrator/throughput.py)
    test/<name>           each evaluation's metrics (loss, accuracy, the task's own)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError
from distrain.orchestrator.callbacks import Callback, RunInfo
from distrain.orchestrator.throughput import SteadyState


class TensorBoardWriter(Callback):
    def __init__(self, root: str | Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # pragma: no cover - installed with ray[tune]
            raise ConfigError("--tensorboard needs the tensorboardX package: pip install tensorboardX") from None
        self._writer_class = SummaryWriter
        self.root = Path(root)
        self.writer: Any = None
        self.workers = 1
        self.meter = SteadyState()
        self.pending: dict[int, list[float]] = {}  # global step -> [loss sum, losses, rows, lr]

    def on_run_start(self, info: RunInfo) -> None:
        self.logdir = self.root / info.run_dir.name
        self.writer = self._writer_class(str(self.logdir))
        self.workers = info.config.num_worker_actors  # rows per global step: one per worker slice

    def on_rows(self, rows: dict[str, list[Any]]) -> None:
        if self.writer is None:
            return
        self.meter.add_steps(rows["step"], rows["samples"], rows["wall_time"], rows.get("dropped"))
        full = []
        for step, loss, lr in zip(rows["step"], rows["loss"], rows["lr"], strict=True):
            entry = self.pending.setdefault(int(step), [0.0, 0, 0, float(lr)])
            if loss is not None and math.isfinite(loss):
                entry[0] += float(loss)
                entry[1] += 1
            entry[2] += 1
            if entry[2] >= self.workers:
                full.append(int(step))
        self._write_steps(sorted(set(full)))

    def on_epoch_end(self, epoch: int, metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        done = int(metrics["steps_done"])
        self._write_steps(sorted(s for s in self.pending if s < done))  # the evaluated steps are all in
        for name, value in metrics.items():
            split, _, metric = name.partition("_")
            if split in ("val", "test") and value is not None:  # val/loss, test/accuracy, ...
                self.writer.add_scalar(f"{split}/{metric}", float(value), done)
        self.writer.flush()

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self.writer is None:
            return
        self._write_steps(sorted(self.pending))
        self.writer.close()
        self.writer = None

    def _write_steps(self, steps: list[int]) -> None:
        if not steps:
            return
        speed = self.meter.samples_per_s()
        for step in steps:
            loss_sum, losses, _, lr = self.pending.pop(step)
            if losses:
                self.writer.add_scalar("train/loss", loss_sum / losses, step + 1)
            self.writer.add_scalar("train/lr", lr, step + 1)
        if speed is not None:
            self.writer.add_scalar("train/samples_per_s", speed, steps[-1] + 1)
