"""The bucketed, backward-overlapped all-reduce equals one flat all-reduce, on a real 2-process gloo group."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_two_rank_script

pytestmark = pytest.mark.integration  # real processes (torch.distributed ranks / a Jupyter kernel)

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn

    from distrain.strategies.collective import OverlappedAllReduce
    from distrain.trainers.datasets import load_dataset
    from distrain.trainers.local_trainer import LocalTrainer
    from distrain.trainers.task import ClassificationTask
    from distrain.trainers.models import build_model


    class WithUnused(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.unused = nn.Linear(4, 4)  # never gets a gradient: its bucket (the last) must not hang
            self.inner = inner

        def forward(self, x):
            return self.inner(x)


    def rank_main(rank, port):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        data = load_dataset("digits")
        task = ClassificationTask()
        trainer = LocalTrainer(WithUnused(build_model("cnn", data.info, 0)), task, "sgd", 0.1, 0.0, 0.0)
        reference = LocalTrainer(WithUnused(build_model("cnn", data.info, 0)), task, "sgd", 0.1, 0.0, 0.0)
        reference.params_flat.copy_(trainer.params_flat)  # the same replica, without hooks
        # Tiny buckets: the cnn (plus an unused layer) becomes several buckets, launched during backward.
        overlap = OverlappedAllReduce(
            trainer.params, trainer.grads_flat, 2, first_bucket_bytes=4096, bucket_bytes=65536
        )
        assert len(overlap.buckets) >= 3, len(overlap.buckets)
        for step in range(3):
            idx = torch.arange(64 * step + 32 * rank, 64 * step + 32 * rank + 32).numpy()
            x, y = data.train_batch(idx)
            trainer.compute_gradients((x, y))
            launched_during_backward = overlap.next
            overlap.finish()
            reference.compute_gradients((x, y))
            local = reference.grads_flat.clone()
            expected = local.clone()
            dist.all_reduce(expected)
            expected /= 2
            assert torch.allclose(trainer.grads_flat, expected, atol=1e-7), (trainer.grads_flat - expected).abs().max()
            assert launched_during_backward >= len(overlap.buckets) - 1  # all but the unused one's bucket
            assert not torch.equal(local, expected)  # the ranks' gradients did differ
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        # Forked, not spawned: the ranks start with torch and distrain already imported here (a spawned
        # rank imports them again, about twice this script's CPU); nothing has run a torch op before.
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True, start_method="fork")
        print("OK")
    """
)


def test_overlapped_buckets_equal_a_flat_allreduce(tmp_path):
    run_two_rank_script(tmp_path, "overlap.py", SCRIPT)
