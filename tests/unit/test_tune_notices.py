"""What `distrain tune` drops of Ray Tune's log on Ctrl-C (tuning/tune.py), without Ray running."""

from __future__ import annotations

import logging

import pytest

from distrain.tuning.tune import _quiet_interrupt_notices

STOP = "Stop signal received (e.g. via SIGINT/Ctrl+C), ending Ray Tune run. ..."
NO_METRICS = "Failed to fetch metrics for 1 trial(s):\n- DistrainTrial_c2cb5_00001: FileNotFoundError(...)"
RESUME = "Experiment has been interrupted, but the most recent state was saved.\nResume experiment with: ..."


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def said():
    """What passes the loggers' filters (a handler on each logger itself: Ray's logging setup may stop
    its records from reaching the root logger that caplog listens to)."""
    kept = Kept()
    loggers = [logging.getLogger(name) for name in ("ray.tune.tune", "ray.tune.analysis.experiment_analysis")]
    for logger in loggers:
        logger.addHandler(kept)
    yield lambda: kept.messages
    for logger in loggers:
        logger.removeHandler(kept)


def test_the_missing_metrics_warning_is_dropped_only_after_a_stop(said):
    tune_log, analysis_log = (
        logging.getLogger(name) for name in ("ray.tune.tune", "ray.tune.analysis.experiment_analysis")
    )
    with _quiet_interrupt_notices():  # a sweep whose trial failed before its first result: worth saying
        analysis_log.warning(NO_METRICS)
    assert said() == [NO_METRICS]
    with _quiet_interrupt_notices():  # Ctrl-C: the CLI's one line says it all
        tune_log.warning(STOP)
        analysis_log.warning(NO_METRICS)
        tune_log.warning(RESUME)
        tune_log.warning("something else")
    assert said() == [NO_METRICS, "something else"]
    analysis_log.warning(NO_METRICS)  # the filters went with the fit
    assert said()[-1] == NO_METRICS
