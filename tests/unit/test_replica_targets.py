"""Where a pipeline's replicas are steered (cluster.replica_targets): no Ray started."""

from __future__ import annotations

from distrain.orchestrator.cluster import replica_targets

ONE_CPU = {"CPU": 1.0}


def test_replicas_go_to_the_node_with_fewest_replicas_that_still_holds_a_whole_one():
    nodes = {"a": {"CPU": 4.0}, "b": {"CPU": 4.0}}
    assert replica_targets(nodes, ONE_CPU, 2, 2) == ["a", "b"]  # room for both on "a": spread anyway
    assert replica_targets(nodes, ONE_CPU, 2, 4) == ["a", "b", "a", "b"]
    # a node too small for a whole replica is skipped; with no room left anywhere: None (PACK, no target)
    assert replica_targets({"small": {"CPU": 1.0}, "big": {"CPU": 4.0}}, ONE_CPU, 2, 3) == ["big", "big", None]
    # ties on replicas go to the node with the most CPUs left
    assert replica_targets({"a": {"CPU": 2.0}, "b": {"CPU": 6.0}}, ONE_CPU, 2, 3) == ["b", "a", "b"]


def test_gpus_count_as_a_bundle_needs_them():
    nodes = {"cpu": {"CPU": 16.0}, "gpu": {"CPU": 8.0, "GPU": 2.0}}
    assert replica_targets(nodes, {"CPU": 1.0, "GPU": 1.0}, 2, 2) == ["gpu", None]
