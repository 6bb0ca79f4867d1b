"""The loggers a run names (--loggers, --tensorboard DIR), built; the back ends are imported only when named."""

from __future__ import annotations

from typing import Any

from distrain.orchestrator.loggers import Logger


def build_loggers(config: Any) -> list[Logger]:
    """The loggers --loggers names (and --tensorboard DIR's, which writes under DIR/<run id>/)."""
    loggers: list[Logger] = []
    if config.tensorboard:
        from distrain.orchestrator.tensorboard import TensorBoardWriter

        loggers.append(TensorBoardWriter(config.tensorboard))
    for name in config.logger_names:
        if name == "tensorboard":
            from distrain.orchestrator.tensorboard import TensorBoardWriter

            loggers.append(TensorBoardWriter(None))
        elif name == "csv":
            from distrain.orchestrator.csv_logger import CsvLogger

            loggers.append(CsvLogger())
        elif name == "mlflow":
            from distrain.orchestrator.mlflow_logger import MlflowLogger

            loggers.append(MlflowLogger(config.mlflow_uri))
    return loggers
