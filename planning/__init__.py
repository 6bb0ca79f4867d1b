"""`distrain plan` and `--strategy auto`: the analytic model (`planner`), its calibration on the cluster at hand
(`calibrate`, `probe`), the command (`command`) and the automatic choice (`auto_strategy`). Above the
orchestrator: calibration starts real runs through it; the orchestrator never imports this package."""
