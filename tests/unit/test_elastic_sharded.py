"""Elastic BSP across cut replicas (`--fsdp D` under `--workers MIN..MAX`, strategies/elastic_sharded_bsp.py):
the config's word, one placement group of D bundles per replica, and a worker's pieces taken out of one
cut trainer and put into another (trainers/replica_shards.py) in a real two-process gloo group.
tests/integration/test_elastic_sharded.py runs the whole thing on a simulated cluster."""

from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from distrain.config import RunConfig
from distrain.orchestrator import cluster, membership
from distrain.strategies.bsp import BSP
from distrain.strategies.elastic_sharded_bsp import ElasticShardedBSP


def test_a_range_of_cut_replicas_runs_elastic_sharded_bsp_over_replica_slots():
    config = RunConfig(model="mlp", workers="2..3", fsdp=2, batch_size=16)
    config.validate()
    assert BSP.implementation(config) is ElasticShardedBSP and ElasticShardedBSP.elastic
    # Slots are replicas: MAX x D actors, a step of MAX x D slices, MIN replicas' CPUs to start.
    assert config.worker_slots == 3 and config.num_worker_actors == 6 and config.global_batch_size == 96
    assert cluster.cpus_needed(config) == 4


class FakeGroup:
    made = 0

    def __init__(self, bundles):
        FakeGroup.made += 1
        self.bundle_specs, self.name = bundles, FakeGroup.made

    def ready(self):
        return ("ready", self.name)


def test_one_placement_group_of_d_bundles_per_replica(monkeypatch):
    monkeypatch.setattr(membership, "placement_group", lambda bundles, strategy: FakeGroup(bundles))
    monkeypatch.setattr(membership, "remove_placement_group", lambda pg: None)
    placed: set[int] = {1}  # group names placed so far
    monkeypatch.setattr(membership.ray, "wait", lambda refs, **kw: ([r for r in refs if r[1] in placed], []))
    config = RunConfig(model="mlp", workers="2..3", fsdp=2)
    p = membership.ElasticPlacement(config)
    assert [len(g.bundle_specs) for g in p.groups] == [2, 2, 2]  # a group per replica, a bundle per worker
    assert p.ready_ranks() == [0, 1]  # replica 0 placed: both its workers
    strategy = p.worker(5)  # replica 2's worker d = 1
    assert strategy.placement_group is p.groups[2] and strategy.placement_group_bundle_index == 1
    placed.add(3)
    assert p.ready_ranks() == [0, 1, 4, 5]
    before = list(p.groups)
    p.renew(5)  # worker 5 lost: its replica's group goes back, a new one is asked for; the others stay
    assert p.groups[:2] == before[:2] and p.groups[2] is not before[2] and p.ready_ranks() == [0, 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from distrain.trainers import replica_shards
    from distrain.trainers.sharded_trainer import ShardedTrainer
    from distrain.trainers.task import ClassificationTask

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    task = ClassificationTask()

    def trainer(seed: int) -> ShardedTrainer:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        t = ShardedTrainer(model, task, "adam", 0.01, None, None)
        t.shard(init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("replicate", "shard", "tp")))
        return t

    torch.manual_seed(10 + rank)
    batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(2)]
    a = trainer(0)
    a.compute_gradients(batches[0])
    a.apply_update(0.01)  # Adam's state exists now: moments cut as the parameters, a step count
    b = trainer(1)  # another start, as a joiner's own seeded model would be
    replica_shards.load_local(b, replica_shards.local_state(a))
    same = replica_shards.digest(a) == replica_shards.digest(b)
    for t in (a, b):  # the same next step from the same state
        t.compute_gradients(batches[1])
        t.apply_update(0.01)
    whole = replica_shards.whole_state(a)
    out[rank] = {
        "copied": same,
        "after": (replica_shards.digest(a), replica_shards.digest(b)),
        "whole": {k: tuple(v.shape) for k, v in whole["model"].items()},
        "optim": (sorted(whole["optimizer"]["vectors"]), sorted(whole["optimizer"]["scalars"])),
    }
    dist.destroy_process_group()


def test_a_workers_pieces_move_into_another_cut_trainer_and_step_alike():
    port = _free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
        out = dict(out)
    for rank in (0, 1):
        assert out[rank]["copied"], out
        first, second = out[rank]["after"]
        assert first == second, out  # the optimizer state came along: Adam's next step is the same
    assert out[0]["after"] != out[1]["after"]  # each worker holds its own chunk
    assert out[0]["whole"] == {"0.weight": (5, 6), "0.bias": (5,), "2.weight": (3, 5), "2.bias": (3,)}
    assert out[0]["optim"] == (["exp_avg", "exp_avg_sq"], ["step"])


def test_a_replica_joins_whole_and_a_lost_worker_takes_its_replica_out_without_a_restart(tmp_path):
    """The scaling policy over the plain-Python group of tests/unit/dummy_group.py: under --fsdp 2 a
    slot is a replica of ranks 2r, 2r + 1. Replica 1 is placed after 4 steps and joins whole (both its
    workers admitted at one boundary, one re-form); its worker 3 then dies: worker 2's process is ended as
    soon as it is back from the block (the other replica's collectives with it then fail at once, not after
    --collective-timeout-s), worker 2 leaves with 3 at the block's end, the slot's group is given back
    once, and the run goes on at MIN with no failure counted."""
    from collections import Counter

    from tests.unit.dummy_group import DummyGroup
    from tests.unit.test_controller import STEPS, config, controller, step_rows

    cfg = config(tmp_path, workers="1..2", fsdp=2, model="mlp", segment_steps=2, checkpoint_steps=0)
    group = DummyGroup(cfg, placed={0: 0, 1: 0, 2: 4, 3: 4}, die={3: 8})
    ctl, events = controller(cfg, group)
    ctl.state.membership.drain_poll_s = 0
    s = ctl.run().summary
    assert s["status"] == "completed" and s["failures"] == 0 and group.restarts == 0
    m = s["membership"]
    moves = [(e["change"], e["rank"]) for e in m["events"] if e["cause"] != "start"]
    assert moves == [("join", 2), ("join", 3), ("leave", 3), ("leave", 2)]
    assert m["events"][-1]["cause"] == "replica of 3 left (worker lost)"
    assert [r["members"] for r in m["reforms"]] == [[0, 1], [0, 1, 2, 3], [0, 1]]
    assert group.log.count(("renew", 3)) == 1 and ("renew", 2) not in group.log  # one group per replica
    ended = [entry for entry in group.log if entry[0] == "end_process"]
    assert ended == [("end_process", 2)] and group.log.index(ended[0]) < group.log.index(("kill", 3))
    without_row = Counter(tuple(u[1:]) for e in m["events"] for u in e.get("units_without_row", []))
    slots = cfg.worker_slots * 2
    assert step_rows(cfg) == Counter({(st, r): 1 for st in range(STEPS) for r in range(slots)}) - without_row


def test_the_membership_line_counts_replicas_against_a_range_of_replicas():
    from distrain.cli import membership_line
    from distrain.orchestrator.membership import MembershipChanged

    event = MembershipChanged(7, "leave", 5, "node lost", 4)
    assert membership_line(event, (2, 3), 2) == "step 7: worker 5 left (node lost); 4 workers, 2 replicas of 2..3"
    assert membership_line(event, (2, 3)) == "step 7: worker 5 left (node lost); 4 of 2..3"
