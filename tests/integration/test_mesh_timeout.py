"""The device mesh's process groups have the run's --collective-timeout-s (strategies/collective.py
`timed_device_mesh`, through `Channel.device_mesh`), as the run's own group does: torch makes a mesh's
groups with its backend default (30 min under gloo) otherwise, so a worker of a cut replica lost alone
left the other replicas' FSDP/HSDP collectives waiting that long (docs/elastic.md). Four gloo ranks on a
(2, 2, 1) mesh: every group of it has the timeout, and a collective of the "shard" group whose peer never
comes fails (a RuntimeError that says it timed out) instead of waiting."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_two_rank_script

pytestmark = pytest.mark.integration  # real torch.distributed ranks

SCRIPT = textwrap.dedent(
    """
    import sys
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from distrain.strategies.collective import CollectiveGroup, timed_device_mesh
    from distrain.trainers.sharded_checkpoint import AsyncSaver

    WORLD, TIMEOUT_S = 4, 3.0
    NAMES = ("replicate", "shard", "tp")


    def rank_main(rank, port):
        CollectiveGroup(rank, WORLD, f"127.0.0.1:{port}", "gloo", TIMEOUT_S)
        mesh = timed_device_mesh("cpu", (2, 2, 1), NAMES, TIMEOUT_S)
        for name in NAMES:
            backend = mesh[name].get_group()._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=TIMEOUT_S), (name, backend.options._timeout)
        saver = AsyncSaver(TIMEOUT_S)  # the sharded checkpoints' own group, made as sharded_bsp.py makes it
        assert saver.group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=TIMEOUT_S)
        # Ranks 0 and 1 are replica 0's "shard" group: rank 1 never joins the all-reduce (a mate lost while
        # alive to the store), so rank 0's fails after the timeout rather than torch's 30 minutes.
        if rank == 0:
            try:
                dist.all_reduce(torch.ones(3), group=mesh["shard"].get_group())
            except RuntimeError as e:
                assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), e
            else:
                raise AssertionError("the all-reduce without its peer returned")
            open(sys.argv[2], "w").write("done")
        elif rank == 1:
            while True:  # alive, never in the collective, until rank 0 is through
                try:
                    if open(sys.argv[2]).read() == "done":
                        break
                except FileNotFoundError:
                    pass
                time.sleep(0.2)


    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=WORLD, join=True, start_method="fork")
        print("OK")
    """
)


def test_every_group_of_the_device_mesh_has_the_collective_timeout(tmp_path):
    run_two_rank_script(tmp_path, "mesh_timeout.py", SCRIPT.replace("sys.argv[2]", repr(str(tmp_path / "done"))))
