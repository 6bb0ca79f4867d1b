"""What a long-lived actor process (a training worker, a parameter-server shard) does once, at its start."""

from __future__ import annotations

import gc

_frozen = False


def freeze_loaded_libraries() -> None:
    """Move every object alive now (torch, numpy, Ray: some 350,000 of them) out of the garbage collector's
    reach, once per process. A warm actor's `retire` collects garbage between runs (orchestrator/
    warm_pool.py): a full collection over those objects took 1.5-1.9 s a worker under load, at every run's
    end, and now scans only what was made since. Once only, at the first run's start, before any task
    file is imported: a later freeze could catch a dropped task module's cycles, which would never be freed."""
    global _frozen
    if not _frozen:
        gc.freeze()
        _frozen = True
