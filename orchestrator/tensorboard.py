"""The TensorBoard logger: a run's figures (orchestrator/loggers.py) as TensorBoard event files.

`--loggers tensorboard` writes them in the run directory (RUN_DIR/tensorboard/, kept and synced with the
run: `tensorboard --logdir runs/` shows every run); `--tensorboard DIR` under DIR/<run id>/ (several runs
with one DIR compare side by side).

Built on tensorboardX, not torch.utils.tensorboard: tensorboardX comes with ray[tune] (a dependency
already) and needs only protobuf, whereas torch.utils.tensorboard imports the `tensorboard` package
(the server, with grpc, werkzeug, markdown) just to write a file. `tensorboard --logdir DIR` reads
either's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrain.errors import ConfigError
from distrain.orchestrator.callbacks import RunInfo
from distrain.orchestrator.loggers import Logger

# The run directory's folder of event files (--loggers tensorboard).
IN_RUN_DIR = "tensorboard"


class TensorBoardWriter(Logger):
    def __init__(self, root: str | Path | None) -> None:
        """`root`: --tensorboard's DIR (events under DIR/<run id>/); None: the run directory's own folder."""
        super().__init__()
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # pragma: no cover - installed with ray[tune]
            raise ConfigError("--tensorboard needs the tensorboardX package: pip install tensorboardX") from None
        self._writer_class = SummaryWriter
        self.root = Path(root) if root is not None else None
        self.writer: Any = None

    def open(self, info: RunInfo) -> None:
        self.logdir = self.root / info.run_dir.name if self.root is not None else info.run_dir / IN_RUN_DIR
        self.writer = self._writer_class(str(self.logdir))

    def write(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, summary: dict[str, Any]) -> None:
        self.writer.close()
        self.writer = None
