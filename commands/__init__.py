"""The bodies of the `distrain` commands and what they draw, one module per job; `cli.py` is the typer
app that declares the commands and hands each its parsed flags.

- `console.py`: the two consoles (stdout, stderr) every command prints to
- `options.py`: the run options as typer parameters, generated from the config's field declarations
- `run.py`: `distrain run` (flags into the spec, then the API's one front door), its exit codes
- `run_display.py`: what `run` shows while it runs; `run_summary.py`: its closing table
- `plan.py`, `tune.py`, `report.py`: those commands and their tables

No Ray, no torch at import: each command imports the orchestrator when it runs.
"""
