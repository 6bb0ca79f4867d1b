"""cProfile of one `TrainWorker`'s steps, in-process, without Ray (world 1, a gloo group of one): what the
worker does per step besides forward and backward (issue 32).

    PYTHONPATH=<dir whose distrain entry is the tree> .venv/bin/python benchmarks/worker_step_cprofile.py [STEPS]

The default task (cnn on digits, batch 32, SGD with momentum), segments of one epoch as the driver deals
them; the first segment is left out (start-up). Prints the step time under the profiler and the functions
by their own time; the profiler inflates Python-heavy parts more than torch kernels.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import tempfile
import time

from distrain.config import RunConfig
from distrain.orchestrator.worker import TrainWorker
from distrain.strategies.collective import host_rendezvous


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    config = RunConfig(
        strategy="bsp",
        workers=1,
        cpus_per_worker=1.0,
        model="cnn",
        dataset="digits",
        batch_size=32,
        lr=0.05,
        lr_scaling="none",
        optimizer="sgd",
        momentum=0.9,
        epochs=20,
        max_steps=steps,
        seed=0,
        run_dir=tempfile.mkdtemp(prefix="worker_step_cprofile-"),
        transport="collective",
        eval_every=0,
    )
    worker = TrainWorker(config, 0, time.time())
    worker._built()  # raises what building the replica raised
    worker.setup(host_rendezvous("127.0.0.1"), [], [])
    spe = worker.sharder.steps_per_epoch
    units = [(s // spe, s % spe, 0) for s in range(steps)]
    segments = [units[i : i + spe] for i in range(0, steps, spe)]
    worker.run_segment(segments[0])
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    for segment in segments[1:]:
        worker.run_segment(segment)
    profile.disable()
    n = sum(len(s) for s in segments[1:])
    print(f"{n} steps, {1e3 * (time.perf_counter() - t0) / n:.3f} ms a step (under cProfile)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
