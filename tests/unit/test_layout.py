"""The layout section (--fsdp D): what it makes of the run's shape, what it refuses, the resume rule at
another layout, FSDP's traffic per step, and the units `fully_shard` wraps. No Ray."""

from __future__ import annotations

import pytest
from torch import nn

from distrain.config import RunConfig
from distrain.config.layout_section import grid_text, layout_of
from distrain.errors import ConfigError
from distrain.orchestrator.checkpoint import LATEST
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run_checks import check_runnable
from distrain.strategies.base import StrategyContext
from distrain.strategies.bsp import BSP
from distrain.strategies.sharded_bsp import ShardedBSP, fsdp_bytes_per_step
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.sharded_trainer import fsdp_units
from distrain.trainers.tensor_parallel import BUILTIN_PLANS, check_plan, local_params


def test_a_sharded_replica_is_d_workers_and_d_batches():
    config = RunConfig(workers=2, fsdp=4, batch_size=16)
    config.validate()
    assert (config.num_worker_actors, config.replica_size, config.global_batch_size) == (8, 4, 128)
    assert config.samples_per_step == 128 and config.sharded
    assert BSP.implementation(config) is ShardedBSP
    assert RunConfig(workers=2).replica_size == 1 and not RunConfig(workers=2).sharded
    assert layout_of(config.to_dict(), 2) == {
        "replicas": 2, "fsdp": 4, "tensor_parallel": 1, "pipeline_stages": 1, "workers_per_replica": 4,
        "worker_actors": 8,
    }  # fmt: skip
    assert config.to_nested()["layout"] == {"fsdp": 4, "tensor_parallel": 1, "reshard_after_forward": True}


def test_the_layout_counts_backup_replicas_among_the_worker_actors():
    """bsp --backup-workers K at a fixed size starts N + K replicas (each of D workers across cut replicas);
    under a range the backups are among the MAX."""
    config = RunConfig(strategy="bsp", transport="ps", workers=2, fsdp=2, backup_workers=1, model="mlp")
    layout = layout_of(config.to_dict(), config.worker_slots)
    assert layout["replicas"] == 2 and layout["worker_actors"] == 6 == config.num_worker_actors
    assert grid_text(layout) == "2 replicas (+1 backup) x 2 shards"
    plain = RunConfig(strategy="bsp", transport="ps", workers=2, backup_workers=2)
    assert grid_text(layout_of(plain.to_dict(), plain.worker_slots)) == "2 workers (+2 backups)"
    ranged = RunConfig(strategy="bsp", transport="ps", workers="2..3", backup_workers=1)
    assert layout_of(ranged.to_dict(), ranged.worker_slots)["worker_actors"] == 3 == ranged.num_worker_actors
    assert grid_text(layout_of(ranged.to_dict(), ranged.worker_slots)) == "2..3 workers"


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(fsdp=0), r"^--fsdp must be >= 1, got 0$"),
        (dict(fsdp=2, strategy="sandblaster", ps_shards=1), r"^--ps-shards 1 with --fsdp 2: PS shard d holds FSDP "),
        (dict(fsdp=2, tensor_parallel=2, strategy="sandblaster", model="mlp"), r"^--strategy sandblaster across cut "
         r"replicas runs with --fsdp D only; --tensor-parallel is not yet supported with it; drop it$"),
        (dict(fsdp=2, strategy="async", ps_shards=4), r"^--ps-shards 4 with --fsdp 2: PS shard d holds FSDP chunk d"),
        (dict(tensor_parallel=2, model="mlp", transport="ps", backup_tasks=True), r"^--tensor-parallel 2 over --t"),
        (dict(fsdp=2, transport="ps", backup_tasks=True, workers="1..2"), r"^--fsdp 2 over --transport ps with --ba"),
        (dict(model="cnn", tensor_parallel=2, pipeline_stages=2), r"^--tensor-parallel 2 with the cnn model's hybrid"),
        (dict(fsdp=2, workers="1..2", strategy="sandblaster"), r"^--strategy sandblaster across cut replicas runs wi"
         r"th --fsdp D only; --workers MIN..MAX is not yet"),
        (dict(fsdp=2, strategy="sandblaster", model="mlp", pipeline_stages=2), r"^--strategy sandblaster across cut "
         r"replicas runs with --fsdp D only; --pipeline-stages is not yet"),
        (dict(fsdp=2, workers="1..2", strategy="diloco", fragments=2), r"^--fragments \(Streaming DiLoCo\) does not c"),
        (dict(fsdp=2, workers="1..2", strategy="local-sgd", adaptive_tau=True), r"^--adaptive-tau does not compose"),
        (dict(fsdp=2, workers="2..3", worker_weights="1,1,2"), r"^--worker-weights 1,1,2 does not compose with --wor"),
        (dict(fsdp=2, transport="ps", compress="powersgd:2"), r"^--compress powersgd:2 needs whole matrices, but a p"),
        (dict(fsdp=2, compress="int8", pipeline_stages=2), r"^--compress does not compose with --pipeline-stages"),
        (dict(fsdp=2, workers="1..2", compress="int8"), r"^--workers 1..2 does not compose with --compress"),
        # (backup workers under a range across cut replicas run, with MIN above them: a round applies members - K)
        (dict(tensor_parallel=2, transport="ps", model="mlp", workers="1..3", backup_workers=1, strategy="bsp"),
         r"^--workers 1..3 with --backup-workers 1: each round applies members - 1 gradients, none at MIN 1"),
        (dict(fsdp=2, transport="ps", strategy="bsp", workers="2..3", backup_workers=2), r"^--workers 2..3 with --b"),
        (dict(tensor_parallel=2, model="mlp", precision="fp16", compress="int8"), r"^--precision fp16 cannot be comb"),
        (dict(fsdp=2, comm_delay_ms=5), r"^--fsdp 2 with --strategy bsp does not compose with --comm-delay-ms/--c"),
        (dict(tensor_parallel=2, comm_bandwidth="1gbit"), r"^--tensor-parallel 2 with --strategy bsp does not comp"),
    ],
)
def test_what_sharding_refuses_in_one_line(given, message):
    with pytest.raises(ConfigError, match=message) as caught:
        RunConfig(**given).validate()
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("strategy", ["local-sgd", "diloco"])
def test_elastic_local_sgd_and_diloco_across_cut_replicas_take_tensor_parallelism_and_precision(strategy):
    """Under --workers MIN..MAX a replica of D x T workers (strategies/elastic_cut.py `ElasticCutBlocks`), in
    fp32, bf16 or fp16, as elastic BSP's: the mlp's plan (its T workers share their samples) and the cnn's
    hybrid (each of its T workers its own, MAX x D x T slices a step)."""
    for model in ("mlp", "cnn"):
        for layout in (dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2), dict(fsdp=2)):
            for precision in ("fp32", "bf16", "fp16"):
                RunConfig(model=model, strategy=strategy, workers="1..2", precision=precision, **layout).validate()


def test_a_range_over_the_ps_takes_tensor_parallel_replicas_and_precision():
    """--workers MIN..MAX across cut replicas over the PS (strategies/sharded_ps.py): async, ssp and bsp take
    --tensor-parallel T alone or with --fsdp D (a replica of D x T joins and leaves whole, one PS shard per
    worker of it), the cnn's hybrid plan, and --precision bf16 (tests/integration/test_sharded_ps_runs.py)."""
    for strategy in ("async", "ssp", "bsp"):
        for layout in (dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2), dict(fsdp=2)):
            for precision in ("fp32", "bf16"):
                config = RunConfig(strategy=strategy, transport="ps", workers="1..2", model="mlp", **layout)
                config.replace(precision=precision).validate()
                assert config.num_worker_actors == 2 * config.replica_size and config.ps_shards == config.replica_size
        RunConfig(strategy=strategy, transport="ps", workers="1..2", model="cnn", tensor_parallel=2).validate()


def test_the_emulated_link_composes_where_the_traffic_across_replicas_goes_through_the_channel():
    """--comm-delay-ms/--comm-bandwidth across cut replicas (issue 28): DiLoCo's, Streaming DiLoCo's and local
    SGD's rounds (under --workers MIN..MAX too), BSP under --compress or unequal replica shares, the PS
    strategies' push-pulls."""
    link = dict(comm_delay_ms=5, comm_bandwidth="1gbit", model="mlp", workers=2)
    for layout in (dict(fsdp=2), dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2)):
        for kw in (
            dict(strategy="diloco"),
            dict(strategy="diloco", fragments=2, overlap_steps=1),
            dict(strategy="local-sgd", tau=4),
            dict(strategy="bsp", compress="int8"),
            dict(strategy="bsp", worker_weights="1,3"),
        ):
            RunConfig(**(link | layout | kw)).validate()
    for layout in (dict(fsdp=2), dict(tensor_parallel=2)):
        for strategy in ("async", "ssp", "bsp"):
            RunConfig(**(link | layout), strategy=strategy, transport="ps").validate()
        for kw in (dict(strategy="diloco"), dict(strategy="local-sgd", tau=4)):  # elastic blocks' rounds
            RunConfig(**(link | layout | kw | {"workers": "1..2"})).validate()


@pytest.mark.parametrize("strategy", ["bsp", "local-sgd", "diloco"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_composes_with_cut_replicas_over_the_collective(strategy, precision):
    """--precision across cut replicas (issue 28): FSDP's mixed precision policy, autocast under tensor
    parallelism alone, fp16's loss scale; bf16 with --compress too (fp16's stays refused: the test above)."""
    for layout in (dict(fsdp=2), dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2)):
        RunConfig(strategy=strategy, workers=2, model="mlp", precision=precision, **layout).validate()
    RunConfig(strategy=strategy, workers=2, fsdp=2, precision="bf16", compress="int8").validate()
    ps = "async" if strategy == "local-sgd" else "ssp" if strategy == "diloco" else "bsp"  # and over the PS
    RunConfig(strategy=ps, transport="ps", workers=2, fsdp=2, model="mlp", precision=precision).validate()


def test_a_range_takes_tensor_parallel_replicas_and_precision_under_bsp():
    """--workers MIN..MAX across cut replicas (strategies/elastic_sharded_bsp.py): --tensor-parallel T alone
    or with --fsdp D, the cnn's hybrid plan, --precision bf16|fp16; a replica of D x T joins and leaves whole,
    the step is MAX x D slices (x T under the hybrid)."""
    from distrain.config.layout_section import data_ranks_per_replica

    for layout, slices in ((dict(tensor_parallel=2), 3), (dict(fsdp=2, tensor_parallel=2), 6)):
        for precision in ("fp32", "bf16", "fp16"):
            config = RunConfig(workers="2..3", model="mlp", precision=precision, batch_size=16, **layout)
            config.validate()
            assert config.worker_slots * data_ranks_per_replica(config) == slices
            assert config.global_batch_size == slices * 16
    hybrid = RunConfig(workers="2..3", model="cnn", tensor_parallel=2, batch_size=16)
    hybrid.validate()
    assert hybrid.num_worker_actors == 6 and hybrid.worker_slots * data_ranks_per_replica(hybrid) == 6


def test_fsdp_mixed_precision_policy_computes_low_and_reduces_float32():
    import torch

    from distrain.trainers.sharded_trainer import mixed_precision_policy

    for precision, low in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = mixed_precision_policy(precision)
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (low, torch.float32, torch.float32)
    fp32 = mixed_precision_policy("fp32")
    assert (fp32.param_dtype, fp32.reduce_dtype, fp32.output_dtype) == (None, None, None)


@pytest.mark.parametrize("strategy", ["bsp", "local-sgd", "diloco"])
@pytest.mark.parametrize("codec", ["fp16", "int8", "topk:0.1", "powersgd:2", "sign"])
def test_compress_composes_with_cut_replicas_over_the_collective(strategy, codec):
    """--compress across cut replicas (issue 28): the average across the replicas goes through the codec;
    under BSP FSDP then stays inside each replica (no HSDP: no codec could act inside FSDP's all-reduce)."""
    for layout in (dict(fsdp=2), dict(tensor_parallel=2), dict(fsdp=2, tensor_parallel=2)):
        config = RunConfig(strategy=strategy, workers=2, model="mlp", compress=codec, **layout)
        config.validate()
        impl = strategy_class(strategy).implementation(config)
        assert issubclass(impl, ShardedBSP) and impl.codes_gradients == (strategy == "bsp")
    bsp = ShardedBSP(RunConfig(workers=2, fsdp=2, compress=codec), StrategyContext(rank=0, world_size=4, device="cpu"))
    assert bsp.channel_grads and not bsp.fsdp_across_replicas
    plain = ShardedBSP(RunConfig(workers=2, fsdp=2), StrategyContext(rank=0, world_size=4, device="cpu"))
    assert not plain.channel_grads and plain.fsdp_across_replicas  # HSDP as before


def test_unequal_replica_shares_average_across_replicas_through_the_channel():
    """--worker-weights across cut replicas: FSDP stays inside each replica and the weighted average
    across them runs after backward (HSDP's all-reduce takes no weight per replica, and inside backward
    it would make every replica's compute time the slowest one's); a replica's share is cut among its
    D ranks (hybrid: D x T), and each worker records its replica's share and weighs its part by b_r x R / B."""
    ctx = StrategyContext(rank=3, world_size=4, device="cpu")
    bsp = ShardedBSP(RunConfig(model="mlp", workers=2, fsdp=2, batch_size=16, worker_weights="3,1"), ctx)
    assert bsp.channel_grads and not bsp.fsdp_across_replicas and bsp.share_cut == 2 and bsp.replica == 1
    bsp.weigh_share(8, 64)  # replica 1's rank 1 of 2: 8 of its 16
    assert bsp.replica_samples == 16 and bsp.channel.gradient_weight == 0.5  # 16 x 2 / 64
    hybrid = RunConfig(model="cnn", workers=2, fsdp=2, tensor_parallel=2, batch_size=8, balance="speed")
    assert ShardedBSP(hybrid, StrategyContext(rank=0, world_size=8, device="cpu")).share_cut == 4
    local = strategy_class("local-sgd").implementation(RunConfig(strategy="local-sgd", workers=2, fsdp=2))
    assert not local(RunConfig(strategy="local-sgd", workers=2, fsdp=2, worker_weights="3,1"), ctx).channel_grads


@pytest.mark.parametrize("strategy", ["async", "ssp", "bsp"])
def test_the_ps_strategies_run_across_cut_replicas(strategy):
    """async, ssp, bsp over --transport ps with --fsdp D (strategies/sharded_ps.py): D PS shards, each
    counting one client per replica."""
    from distrain.strategies.partition import ps_clients
    from distrain.strategies.sharded_ps import ShardedPS
    from distrain.strategies.strategy_lookup import strategy_class

    config = RunConfig(strategy=strategy, transport="ps", workers=3, fsdp=2, model="mlp")
    config.validate()
    impl = strategy_class(strategy).implementation(config)
    assert issubclass(impl, ShardedPS) and impl.name == strategy
    assert config.ps_shards == 2 and ps_clients(config) == 3 and config.num_worker_actors == 6
    assert impl.ps_rule(config).mode == ("rounds" if strategy == "bsp" else "bounded")


def test_backup_workers_and_compress_run_with_the_ps_across_cut_replicas():
    """bsp --backup-workers K over --transport ps with --fsdp D: N + K replicas are the shards' clients, and
    a round takes N of them, each in D parts (one per shard: the shards agree on the N); --compress
    composes with every PS strategy there (each worker's chunk through the codec)."""
    from distrain.strategies.partition import ps_clients
    from distrain.strategies.sharded_ps import ShardedBSPOverPS
    from distrain.strategies.strategy_lookup import strategy_class

    config = RunConfig(strategy="bsp", transport="ps", workers=3, fsdp=2, backup_workers=1, model="mlp")
    config.validate()
    assert strategy_class("bsp").implementation(config) is ShardedBSPOverPS
    rule = ShardedBSPOverPS.ps_rule(config)
    assert (rule.mode, rule.accept, rule.parts) == ("rounds", 3, 2)
    assert ps_clients(config) == 4 and config.num_worker_actors == 8 and config.global_batch_size == 3 * 2 * 32
    plain = ShardedBSPOverPS.ps_rule(config.replace(backup_workers=0))
    assert (plain.accept, plain.parts) == (None, 1)  # every replica, no referee
    # Under a range: the elastic rule over MAX replica slots, K among the members, and the referee on
    # (parts = D) with or without backups: the shards agree every round there.
    ranged = RunConfig(strategy="bsp", transport="ps", workers="2..3", fsdp=2, backup_workers=1, model="mlp")
    ranged.validate()
    rule = ShardedBSPOverPS.ps_rule(ranged)
    assert (rule.accept, rule.backups, rule.slots, rule.parts) == (None, 1, 3, 2) and ranged.num_worker_actors == 6
    assert ShardedBSPOverPS.ps_rule(ranged.replace(backup_workers=0)).parts == 2
    for strategy in ("async", "ssp", "bsp"):
        RunConfig(strategy=strategy, transport="ps", workers=2, fsdp=2, compress="int8", model="mlp").validate()


def test_fsdp_traffic_per_worker_and_step():
    """HSDP: (2 or 1 all-gathers + 1 reduce-scatter) x (D-1)/D x the bytes, plus 2(R-1)/R of a shard."""
    assert fsdp_bytes_per_step(4000, 1, 4, True) == 3 * 3000
    assert fsdp_bytes_per_step(4000, 1, 4, False) == 2 * 3000
    assert fsdp_bytes_per_step(4000, 2, 2, True) == 3 * 2000 + 2000
    assert fsdp_bytes_per_step(4000, 1, 1, True) == 0
    # --precision bf16/fp16: the parameters gathered in 2 bytes, the gradient reduced in 4
    assert fsdp_bytes_per_step(4000, 1, 4, True, gather_bytes=2000) == (2 * 2000 + 4000) * 3 // 4
    assert fsdp_bytes_per_step(4000, 2, 2, False, gather_bytes=2000) == (2000 + 4000) // 2 + 2000


def test_fully_shard_units_are_the_layers_holding_parameters():
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2), nn.ReLU())
    model.add_module("blocks", blocks)
    assert fsdp_units(model) == [model[1], blocks[0], blocks[1]]


def _recorded_run(tmp_path, **kw):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / LATEST).write_text('{"name": "step-00000004.pt", "global_step": 4}\n')
    (run / "config.yaml").write_text(RunConfig(run_dir=str(run), **kw).to_yaml())
    return run


def test_resume_may_change_the_layout_of_a_bsp_run_at_the_same_global_batch(tmp_path):
    run = _recorded_run(tmp_path, workers=1, fsdp=4, batch_size=16)
    moved = resume_config(run, {"fsdp": 2, "batch_size": 32})
    assert (moved.fsdp, moved.batch_size, moved.global_batch_size) == (2, 32, 64)
    assert resume_config(run, {"fsdp": 1, "workers": 2, "batch_size": 32}).num_worker_actors == 2
    refused = r"^--resume cannot change --batch-size here: .* from 64 to 128, and the data order with it; keep it at 64"
    with pytest.raises(ConfigError, match=refused):
        resume_config(run, {"batch_size": 32})
    with pytest.raises(ConfigError, match=r"^--resume cannot change --workers to a range"):
        resume_config(run, {"workers": "1..2", "fsdp": 1})


def test_resume_keeps_the_layout_of_other_strategies(tmp_path):
    run = _recorded_run(tmp_path, workers=2, strategy="local-sgd", batch_size=16)
    with pytest.raises(ConfigError, match=r"^--resume cannot change --workers \(the run has 2, got 4\)"):
        resume_config(run, {"workers": 4, "batch_size": 8})


def test_the_display_names_the_grid():
    assert grid_text({"replicas": 2, "fsdp": 2, "pipeline_stages": 1}) == "2 replicas x 2 shards"
    assert grid_text({"replicas": 1, "fsdp": 1, "pipeline_stages": 4}) == "1 replica x 4 stages"
    assert grid_text({"replicas": 2, "fsdp": 2, "tensor_parallel": 2}) == "2 replicas x 2 shards x 2 tensor-parallel"
    assert grid_text({"replicas": "2..4"}) == "2..4 workers"  # a summary from before the grid was recorded


def test_tensor_parallel_workers_share_a_slice():
    config = RunConfig(model="mlp", workers=2, fsdp=2, tensor_parallel=2, batch_size=16)  # the cnn's is a hybrid
    config.validate()
    assert (config.num_worker_actors, config.replica_size, config.global_batch_size) == (8, 4, 64)
    assert BSP.implementation(config) is ShardedBSP and RunConfig(tensor_parallel=2).sharded
    with pytest.raises(ConfigError, match=r"^--tensor-parallel must be >= 1, got 0$"):
        RunConfig(tensor_parallel=0).validate()
    # Over the PS (strategies/sharded_ps.py): T shards, shard t holding TP rank t's part; under D x T one shard per
    # worker of a replica (shard d x T + t: worker (d, t)'s piece); the cnn's hybrid plan (its T workers on their
    # own samples); another shard count is refused in one line.
    ps = RunConfig(model="mlp", workers=2, tensor_parallel=2, strategy="ssp", transport="ps")
    ps.validate()
    assert ps.ps_shards == 2 and ps.num_worker_actors == 4
    with pytest.raises(ConfigError, match=r"^--ps-shards 3 with --tensor-parallel 2: PS shard t holds tensor-parallel"):
        RunConfig(model="mlp", tensor_parallel=2, strategy="ssp", transport="ps", ps_shards=3).validate()
    both = RunConfig(model="mlp", workers=2, fsdp=2, tensor_parallel=2, strategy="async", transport="ps", batch_size=8)
    both.validate()
    assert (both.ps_shards, both.num_worker_actors, both.global_batch_size) == (4, 8, 32)
    with pytest.raises(ConfigError, match=r"^--ps-shards 2 with --fsdp 2 --tensor-parallel 2: PS shard d x T \+ t"):
        RunConfig(model="mlp", fsdp=2, tensor_parallel=2, strategy="bsp", transport="ps", ps_shards=2).validate()
    hybrid = RunConfig(model="cnn", workers=1, tensor_parallel=2, strategy="bsp", transport="ps", batch_size=8)
    hybrid.validate()
    assert (hybrid.ps_shards, hybrid.num_worker_actors, hybrid.global_batch_size) == (2, 2, 16)
    with pytest.raises(ConfigError, match=r"^--strategy sandblaster across cut replicas runs with --fsdp D only; --te"):
        RunConfig(tensor_parallel=2, strategy="sandblaster").validate()
    cut = RunConfig(model="linear", workers=2, fsdp=2, strategy="sandblaster")
    cut.validate()  # --fsdp D: D PS shards by default, a replica's D workers taking each portion together
    assert (cut.ps_shards, cut.num_worker_actors) == (2, 4)


def test_a_plan_is_checked_against_the_model_in_one_line():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    plan = BUILTIN_PLANS["mlp"]
    check_plan(mlp, plan, 4, "--model mlp")  # 256 columns and rows split 4 ways
    for bad, message in [
        ((None, 2), r"^--tensor-parallel 2 needs a tensor-parallel plan and --model mlp has none; define"),
        ((plan, 3), r"^--tensor-parallel 3 does not divide '1''s 256 outputs \(colwise\); pick T that divides it$"),
        (({"9": "colwise"}, 2), r"^--tensor-parallel 2: the plan names '9', which --model mlp's model does not have$"),
        (({"1": "diagonal"}, 2), r"^--tensor-parallel 2: the plan's style 'diagonal' for '1' is not one of"),
        (({"2": "colwise"}, 2), r"^--tensor-parallel 2: '2' is a ReLU; 'colwise'/'rowwise' split nn.Linear$"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_plan(mlp, *bad, "--model mlp")
    # One worker of two holds half of each split weight, half of the colwise bias, the rowwise bias whole.
    assert local_params(mlp, plan, 2) == (64 * 256 + 256) // 2 + 256 * 256 // 2 + 256 + 256 * 10 + 10


def test_the_builtin_models_without_a_plan_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"^--tensor-parallel 2 needs a tensor-parallel plan and --model linear has"):
        check_runnable(RunConfig(model="linear", tensor_parallel=2))
    assert check_runnable(RunConfig(model="mlp", tensor_parallel=2)) == 85002


def test_diloco_across_cut_replicas_is_its_own_implementation_streaming_included():
    from distrain.strategies.diloco import DiLoCo
    from distrain.strategies.sharded_diloco import ShardedDiLoCo

    config = RunConfig(strategy="diloco", workers=2, fsdp=2)
    config.validate()
    assert DiLoCo.implementation(config) is ShardedDiLoCo
    # Streaming DiLoCo across cut replicas: fragments of whole tensors, each worker syncing its parts of them.
    streaming = RunConfig(
        model="mlp", strategy="diloco", workers=2, tensor_parallel=2, sync_every=4, fragments=2, overlap_steps=1,
        mix_alpha=0.5,
    )  # fmt: skip
    streaming.validate()
    assert DiLoCo.implementation(streaming) is ShardedDiLoCo
    assert check_runnable(streaming) == 85002
    # Under a range: its own elastic implementation (strategies/elastic_cut.py), one fragment only (Streaming
    # DiLoCo never takes a range).
    from distrain.strategies.elastic_cut import ElasticShardedDiLoCo, ElasticShardedLocalSGD
    from distrain.strategies.local_sgd import LocalSGD

    for strategy, impl in (("diloco", ElasticShardedDiLoCo), ("local-sgd", ElasticShardedLocalSGD)):
        ranged = RunConfig(strategy=strategy, workers="1..3", fsdp=2)
        ranged.validate()
        assert (DiLoCo if strategy == "diloco" else LocalSGD).implementation(ranged) is impl
    with pytest.raises(ConfigError, match=r"^--fragments \(Streaming DiLoCo\) does not compose with --workers MIN"):
        RunConfig(strategy="diloco", workers="1..3", fsdp=2, sync_every=4, fragments=2).validate()


def test_a_sharded_fp16_trainer_keeps_the_loss_scale_in_its_state_and_takes_it_back():
    """fp16 across cut replicas uses LocalTrainer's LossScaler: in the state a checkpoint keeps (rank 0's,
    the same on every worker), restored beside a sharded reference or a whole state; none in fp32/bf16."""
    from distrain.trainers.sharded_trainer import ShardedTrainer
    from distrain.trainers.task import ClassificationTask

    def trainer(precision):
        task = ClassificationTask(model="mlp")
        return ShardedTrainer(task.build_model(), task, "sgd", 0.1, 0.9, None, precision=precision)

    assert trainer("bf16").scaler is None and trainer("bf16").scaler_state() == {}
    fp16 = trainer("fp16")
    assert fp16.scaler_state() == {"scaler": fp16.scaler.state_dict()} and fp16.scaler.scale == 2.0**16
    saved = dict(fp16.scaler.state_dict(), scale=2.0**12, overflows=4)
    fp16.load_state_dict({"sharded": {"path": "/nowhere", "step": 8}, "scaler": saved})
    assert fp16.scaler.state_dict() == saved and fp16._pending_dir is not None  # the shards read once cut
    whole = trainer("fp16")
    state = {"model": whole.model.state_dict(), "optimizer": {"vectors": {}, "scalars": {}}, "scaler": saved}
    whole.load_state_dict(state)
    assert whole.scaler.state_dict() == saved
