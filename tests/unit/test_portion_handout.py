"""The two actors that hand out portions (backup tasks' scheduler per round, Sandblaster's coordinator per
data pass) are one `PortionHandout` (strategies/portion_scheduler.py): a lost worker's portions and the
straggler verdict are handled once, for both."""

from __future__ import annotations

import asyncio

import pytest

from distrain.strategies.portion_scheduler import PortionHandout, PortionScheduler
from distrain.strategies.sandblaster_coordinator import LocalShards, SandblasterCoordinator


def scheduler() -> PortionScheduler:
    return PortionScheduler(per_round=3, steps_per_epoch=10, start_step=0)


def coordinator() -> SandblasterCoordinator:
    return SandblasterCoordinator(LocalShards([]), "gd", tasks_per_pass=3, copies=True, lr=0.1)


async def take(handout: PortionHandout, worker: int) -> int:
    if isinstance(handout, PortionScheduler):
        task = await handout.acquire(worker, None, 0, 0)
    else:
        task = await handout.acquire(worker, None, 0)
    assert task is not None and not task.copy
    return task.portion


def reissued(handout: PortionHandout) -> int:
    return handout.stats()["reissued"] if isinstance(handout, PortionScheduler) else handout.it["reissued"]


@pytest.mark.parametrize("make", [scheduler, coordinator])
def test_a_lost_worker_s_portions_go_back_to_the_front_and_are_counted(make):
    async def scenario() -> None:
        handout = make()
        assert [await take(handout, 0), await take(handout, 1), await take(handout, 0)] == [0, 1, 2]
        assert await handout.worker_lost(0) == 2  # portions 0 and 2 were only worker 0's
        assert {await take(handout, 1), await take(handout, 1)} == {0, 2}  # handed out again, not as copies
        assert reissued(handout) == 2
        assert await handout.worker_lost(3) == 0  # held nothing
        await handout.mark_slow([1])
        assert handout.slow == {1}

    asyncio.run(scenario())
