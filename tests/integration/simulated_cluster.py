"""A simulated multi-node Ray cluster (ray.cluster_utils.Cluster) for the elastic tests' scripts, which
run in a subprocess each (one Ray per process): they import this module from the repository root, their
working directory. Nodes are added and removed by the scripts as their scenario goes."""

from __future__ import annotations

import psutil
import ray
from ray.cluster_utils import Cluster

# A lost node is noticed within 1.5 s (3 missed checks 0.5 s apart), not Ray's default 30 s.
FAST_HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
}


def start(head_cpus: int) -> Cluster:
    """A head node of `head_cpus` CPUs, with this process's Ray connected to it."""
    head = {"num_cpus": head_cpus, "_system_config": FAST_HEALTH_CHECKS}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    ray.init(address=cluster.address)
    return cluster


def crash(cluster: Cluster, node) -> None:
    """A node crash: its processes die at once (remove_node alone lets workers finish their rounds while the
    raylet goes), then the node is gone."""
    raylets = [info.process.pid for info in node.all_processes.get("raylet", [])]
    for child in [c for pid in raylets for c in psutil.Process(pid).children(recursive=True)]:
        child.kill()
    cluster.remove_node(node, allow_graceful=False)
