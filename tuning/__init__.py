"""`distrain tune`: the sweep's dimensions (`sweep_spec`, no Ray) and the Ray Tune driver (`tune`). Above the
orchestrator: every trial is one `run_training`; the orchestrator never imports this package."""
