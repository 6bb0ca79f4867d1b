"""An actor process freezes what it loaded once (distrain/actor_process.py), so a warm actor's garbage
collection between runs scans only the runs' objects."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
import torch  # what an actor has loaded before its first run
from distrain.actor_process import freeze_loaded_libraries
freeze_loaded_libraries()
first = gc.get_freeze_count()
class Cycle:
    pass
garbage = [Cycle() for _ in range(1000)]
for c in garbage:
    c.me = c
freeze_loaded_libraries()  # a second run's start: nothing more is frozen
print(first, gc.get_freeze_count())
del garbage, c
print(gc.collect())
"""


def test_the_loaded_libraries_are_frozen_once_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    first, again, collected = (int(x) for x in out)
    assert first > 100_000  # torch's objects, out of the collector's reach
    assert again == first
    assert collected >= 1000  # the cycles made after the freeze are freed as before
