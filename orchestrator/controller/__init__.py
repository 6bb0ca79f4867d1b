"""The run's controller: its life as one state machine (`status.py`) over a `WorkerGroup` (`group.py`;
the Ray one is `ray_group.py`). orchestrator/run.py builds it; docs/architecture.md, "The controller"."""
