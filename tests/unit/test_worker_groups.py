"""Resource groups (config/groups_section.py): --worker-group and YAML resources.worker_groups read the
same, what they replace (--workers, --batch-size, --gpus-per-worker) follows from them, each rank's share
is its group's batch, and each rank's placement bundle asks for its group's resources."""

from __future__ import annotations

import pytest

from distrain.config import RunConfig
from distrain.config.groups_section import WorkerGroup, parse_group, rank_groups, worker_cpus
from distrain.config.layout_section import global_batch_of
from distrain.errors import ConfigError
from distrain.orchestrator import cluster
from distrain.orchestrator.trial_resources import trial_bundles

FAST_SLOW = ["fast:1:48:fast=1", "slow:1:16:slow=1"]


def test_the_flag_reads_name_count_batch_and_resources():
    assert parse_group("fast:1:48:fast=1") == WorkerGroup("fast", 1, 48, (("fast", 1.0),))
    assert parse_group("cpu:4:16:CPU=8,cpu_node=1") == WorkerGroup("cpu", 4, 16, (("CPU", 8.0), ("cpu_node", 1.0)))
    assert parse_group("gpu:2:96") == WorkerGroup("gpu", 2, 96)
    assert parse_group("cpu:4:16:CPU=8,cpu_node=1").spec() == "cpu:4:16:CPU=8,cpu_node=1"


@pytest.mark.parametrize(
    "spec",
    ["fast", "fast:1", "fast:x:48", "fast:1:4.5", ":1:48", "fast:1:48:", "fast:1:48:=1", "fast:1:48:a=1,a=2"],
)
def test_a_malformed_group_is_one_error_naming_the_syntax(spec):
    with pytest.raises(ConfigError, match="--worker-group"):
        parse_group(spec)


def test_groups_replace_workers_and_batch_size_and_make_the_global_batch_and_the_shares():
    config = RunConfig(worker_groups=FAST_SLOW)
    assert (config.workers, config.batch_size, config.gpus_per_worker) == (2, 48, 0.0)
    assert config.global_batch_size == config.samples_per_step == 64
    assert config.worker_shares == (48, 16)
    three = RunConfig(worker_groups=["a:2:10", "b:1:5"], accumulate_steps=2)
    assert three.workers == 3 and three.global_batch_size == 50 and three.worker_shares == (20, 20, 10)
    assert [g.name for g in rank_groups(three)] == ["a", "a", "b"]  # ranks dealt group by group, in order


def test_yaml_mapping_and_flag_strings_give_the_same_run_and_config_yaml_round_trips(tmp_path):
    yaml_file = tmp_path / "groups.yaml"
    yaml_file.write_text(
        "resources:\n"
        "  worker_groups:\n"
        "    - {name: fast, workers: 1, batch_size: 48, cpus_per_worker: 2, resources: {fast: 1}}\n"
        "    - {name: slow, workers: 1, batch_size: 16, resources: {slow: 1}}\n"
    )
    from_yaml = RunConfig.resolve(str(yaml_file), {})
    from_flags = RunConfig.resolve(None, {"worker_groups": ["fast:1:48:CPU=2,fast=1", "slow:1:16:slow=1"]})
    assert from_yaml == from_flags
    assert from_yaml.worker_groups == ["fast:1:48:CPU=2,fast=1", "slow:1:16:slow=1"]
    recorded = tmp_path / "config.yaml"
    recorded.write_text(from_yaml.to_yaml())  # holds workers and batch_size too: they agree, so it loads
    assert RunConfig.resolve(str(recorded), {}) == from_yaml
    assert from_yaml.replace(epochs=3).worker_shares == (48, 16)
    assert global_batch_of(from_yaml.to_dict(), 2) == 64  # what summary.json records


def test_a_replaced_flag_given_as_well_must_agree():
    assert RunConfig(worker_groups=FAST_SLOW, workers=2, batch_size=48).workers == 2
    for clash in ({"workers": 3}, {"workers": "2..3"}, {"batch_size": 32}, {"worker_weights": "3,1"}):
        with pytest.raises(ConfigError, match="cannot be combined with it"):
            RunConfig(worker_groups=FAST_SLOW, **clash)


def test_every_group_asks_for_the_same_gpus_and_the_run_takes_them():
    gpus = RunConfig(worker_groups=["a:1:48:GPU=1", "b:1:16:GPU=1,slow=1"])
    assert gpus.gpus_per_worker == 1.0 and gpus.uses_gpus
    assert RunConfig(worker_groups=["a:1:48", "b:1:16"], gpus_per_worker=1).gpus_per_worker == 1.0
    with pytest.raises(ConfigError, match="ask for 0 and 1 GPUs per worker"):
        RunConfig(worker_groups=["gpu:1:48:GPU=1", "cpu:1:16"])


def test_each_rank_bundle_asks_for_its_groups_resources():
    config = RunConfig(worker_groups=["fast:1:48:fast=1", "slow:2:16:CPU=3,slow=1"], cpus_per_worker=2)
    expected = [{"CPU": 2.0, "fast": 1.0}, {"CPU": 3.0, "slow": 1.0}, {"CPU": 3.0, "slow": 1.0}]
    assert cluster.bundles(config) == expected
    assert trial_bundles(config)[1:] == expected  # a Tune trial's worker bundles (after the driver's)
    assert cluster.cpus_needed(config) == 8.0
    assert [worker_cpus(config, r) for r in range(3)] == [2.0, 3.0, 3.0]  # the actor's CPUs, its torch threads
    gpus = RunConfig(worker_groups=["a:1:48:GPU=1,fast=1", "b:1:16:GPU=1"])
    assert cluster.bundles(gpus) == [{"CPU": 1.0, "GPU": 1.0, "fast": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    plain = RunConfig(workers=2, cpus_per_worker=2)
    assert cluster.bundles(plain) == [{"CPU": 2.0}, {"CPU": 2.0}]


def test_groups_take_the_shares_path_so_balance_starts_from_their_batches():
    config = RunConfig(worker_groups=FAST_SLOW, balance="speed")
    assert config.worker_shares == (48, 16)
    with pytest.raises(ConfigError, match="--worker-group does not compose with --pipeline-stages"):
        RunConfig(worker_groups=FAST_SLOW, pipeline_stages=2)


def test_a_cluster_without_a_groups_resource_or_its_cpus_is_refused_before_placement(monkeypatch):
    from distrain.errors import ResourceError

    config = RunConfig(worker_groups=["fast:1:48:CPU=3,fast=1", "slow:1:16:slow=1"])
    have = {"CPU": 8.0, "fast": 1.0}
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: dict(have))
    with pytest.raises(ResourceError, match="need 1 of resource 'slow' but the cluster has 0"):
        cluster.check_resources(config)
    have.update(slow=1.0, CPU=3.0)
    with pytest.raises(ResourceError, match=r"needs 4 CPUs \(2 workers x their groups' CPUs\)"):
        cluster.check_resources(config)
    have["CPU"] = 4.0
    cluster.check_resources(config)  # fits
