"""Local SGD's averaging round on a real 2-process gloo group: parameters and momentum buffers are
both replaced by their mean over the workers (the documented optimizer-state rule), the emulated
delay is inside the recorded round time, and the bytes are the ring all-reduce's count."""

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

    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.collective import ring_allreduce_bytes
    from distrain.strategies.local_sgd import LocalSGD
    from distrain.trainers.datasets import load_dataset
    from distrain.trainers.local_trainer import LocalTrainer
    from distrain.trainers.task import ClassificationTask
    from distrain.trainers.models import build_model


    def rank_main(rank, port):
        torch.set_num_threads(1)
        config = RunConfig(strategy="local-sgd", tau=2, momentum=0.9, comm_delay_ms=30, workers=2)
        data = load_dataset("digits")
        trainer = LocalTrainer(build_model("cnn", data.info, 0), ClassificationTask(), "sgd", 0.1, 0.9, 0.0)
        strategy = LocalSGD(config, StrategyContext(rank, 2, "cpu", f"127.0.0.1:{port}"))
        strategy.setup(trainer)

        def batch(step):
            idx = torch.arange(64 * step + 32 * rank, 64 * step + 32 * rank + 32).numpy()
            return data.train_batch(idx)

        trainer.compute_gradients(batch(0))
        first = strategy.step(trainer, 0.1)  # local step 1 of 2: no communication
        assert first.bytes_sent == 0 and first.seconds == 0 and first.averaging_round == 0 and first.period == 2
        trainer.compute_gradients(batch(1))
        # Step 2 by hand, to see the replica just before its round.
        trainer.apply_update(0.1)
        strategy.pending += 1
        before_p = trainer.params_flat.clone()
        before_m = trainer.flat_optimizer_state().vectors["momentum_buffer"].clone()
        mean_p, mean_m = before_p.clone(), before_m.clone()
        dist.all_reduce(mean_p)
        dist.all_reduce(mean_m)
        mean_p /= 2
        mean_m /= 2
        assert not torch.equal(before_p, mean_p) and not torch.equal(before_m, mean_m)  # the replicas had drifted
        stats = strategy.average(trainer)
        after_m = trainer.flat_optimizer_state().vectors["momentum_buffer"]
        assert torch.allclose(trainer.params_flat, mean_p, atol=1e-7), (trainer.params_flat - mean_p).abs().max()
        assert torch.allclose(after_m, mean_m, atol=1e-7), (after_m - mean_m).abs().max()
        # every rank leaves the round with the very same parameters and momentum
        others_p, others_m = trainer.params_flat.clone(), after_m.clone()
        dist.broadcast(others_p, src=0)
        dist.broadcast(others_m, src=0)
        assert torch.equal(others_p, trainer.params_flat) and torch.equal(others_m, after_m)
        assert stats.seconds >= 0.03, stats.seconds  # the emulated delay is part of the round's recorded time
        n = trainer.numel
        assert stats.bytes_sent == ring_allreduce_bytes((2 * n + 3) * 4, 2)  # θ, momentum, 3 statistics
        assert strategy.rounds == 1 and strategy.pending == 0
        # the optimizer keeps stepping from the averaged buffers
        trainer.compute_gradients(batch(2))
        assert strategy.step(trainer, 0.1).averaging_round == 1
        dist.barrier()
        strategy.teardown()


    if __name__ == "__main__":
        # Forked, not spawned: the ranks start with torch and distrain already imported here (a spawned
        # rank imports them again, about twice this script's CPU); nothing has run a torch op before.
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True, start_method="fork")
        print("OK")
    """
)


def test_averaging_round_averages_parameters_and_momentum(tmp_path):
    run_two_rank_script(tmp_path, "local_sgd_round.py", SCRIPT)
