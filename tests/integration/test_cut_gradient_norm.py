"""--clip-grad-norm's norm over a cut replica (trainers/cut_gradient_norm.py) on real 4-process gloo groups:
under FSDP + tensor parallelism, tensor parallelism alone (plain tensors beside DTensors), HSDP across
replicas, FSDP cut unevenly and FSDP inside each of two replicas, the norm every worker computes is the
norm of the whole gradient that update applies (one process's, on the same samples), the clip leaves
exactly that gradient scaled to the limit, and --accumulate-steps 2 gives the same gradient as one
micro-batch."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_two_rank_script

pytestmark = pytest.mark.integration  # real torch.distributed ranks

SCRIPT = textwrap.dedent(
    """
    import copy
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from distrain.trainers.cut_gradient_norm import cut_gradient_norm
    from distrain.trainers.sharded_trainer import ShardedTrainer
    from distrain.trainers.task import Task

    WORLD = 4
    # (R, D, T, FSDP across replicas): each a layout ShardedBSP, ShardedLocalSGD or ShardedDiLoCo makes.
    LAYOUTS = [(1, 2, 2, True), (2, 1, 2, False), (2, 1, 2, True), (1, 4, 1, True), (2, 2, 1, False)]


    class Tiny(Task):
        def build_model(self):
            torch.manual_seed(0)  # 10 outputs: cut 3, 3, 3, 1 over D = 4
            layers = [nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10)]
            return nn.Sequential(nn.Flatten(), *layers)

        def loss(self, model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        def tensor_parallel_plan(self, tp):
            return {"1": "colwise", "3": "rowwise"}


    def batch_of(data_rank):
        g = torch.Generator().manual_seed(100 + data_rank)
        return torch.randn(8, 6, generator=g), torch.randint(0, 10, (8,), generator=g)


    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t


    def rank_main(rank, port):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        task = Tiny()
        for R, D, T, across in LAYOUTS:
            groups = None
            if not across and R > 1:
                replicas = [list(range(r * D * T, (r + 1) * D * T)) for r in range(R)]
                groups, _ = dist.new_subgroups_by_enumeration(replicas)
            mesh = init_device_mesh("cpu", (R, D, T), mesh_dim_names=("replicate", "shard", "tp"))
            dp_rank, tp_rank = divmod(rank, T)
            replica = dp_rank // D
            # The data ranks whose mean gradient the update applies: every one, or the replica's own D.
            ranks = range(R * D) if across else range(replica * D, (replica + 1) * D)
            xs, ys = zip(*(batch_of(r) for r in ranks))
            reference = task.build_model()
            task.loss(reference, (torch.cat(xs), torch.cat(ys))).backward()
            expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
            for k in (1, 2):
                trainer = ShardedTrainer(task.build_model(), task, "sgd", 0.1, 0.0, None, accumulate_steps=k)
                trainer.shard(mesh, across_replicas=across)
                trainer.compute_gradients(batch_of(dp_rank))
                grads = [p.grad for p in trainer.params]
                norm = float(cut_gradient_norm(grads, groups, trainer.tp_rank))
                want = float(expected.norm())
                assert abs(norm - want) <= 1e-5 * want, (R, D, T, k, norm, want)
                limit = norm / 4
                trainer.clip_gradient_(groups, limit=limit)
                clipped = torch.cat([whole(g).reshape(-1) for g in grads])
                scaled = expected * (limit / (want + 1e-6))
                assert torch.allclose(clipped, scaled, atol=1e-6), (R, D, T, k, (clipped - scaled).abs().max())
                trainer.clip_gradient_(groups, limit=norm)  # above the norm now: nothing changes
                assert torch.equal(torch.cat([whole(g).reshape(-1) for g in grads]), clipped)
            dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=WORLD, join=True, start_method="fork")
        print("OK")
    """
)


def test_the_norm_of_a_cut_gradient_counts_every_element_once(tmp_path):
    run_two_rank_script(tmp_path, "cut_norm.py", SCRIPT)
