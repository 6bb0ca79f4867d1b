"""The Ray cluster launcher configs (cluster.yaml, cluster-local.yaml), checked offline.

`ray up` loads the YAML and runs `commands._bootstrap_config` before it touches any machine:
`prepare_config` (merge with the provider's defaults.yaml, merge setup commands, fill per-type
min/max workers), the provider's `fillout_available_node_types_resources`, `validate_config`
(jsonschema against ray-schema.json plus the head-type and min-workers checks) and the provider's
`bootstrap_config`. These tests run that same function. For the `local` provider every step is
offline and runs as is. For AWS the two provider steps call EC2 (instance-type lookup, then IAM role,
key pair, subnets, security groups) with boto3 and credentials, so they are replaced by an offline
stand-in: the lookup fails, as it does for `ray up` without network (Ray then only warns, so the
file must state every node type's resources itself), and bootstrap runs only its offline first step
(`check_legacy_fields`). Nothing here starts Ray or needs network or credentials.
"""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.autoscaler._private import commands, providers
from ray.autoscaler._private.util import check_legacy_fields, prepare_config, validate_config
from ray.autoscaler.node_provider import NodeProvider

ROOT = Path(__file__).resolve().parents[2]
AWS_FILE = ROOT / "cluster.yaml"
LOCAL_FILE = ROOT / "cluster-local.yaml"
FILES = [AWS_FILE, LOCAL_FILE]

# A mapping key at the start of a line (also the first key of a list item): `key:`, `"key":`.
KEY_LINE = re.compile(r"""^(?P<indent>\s*)(?:-\s+)?(?P<key>"[^"]*"|'[^']*'|[A-Za-z_][\w.\-]*)\s*:(?:\s|$)""")
RAY_PIN = re.compile(r"""\bray\[[^\]]*\]\s*(?P<spec>[<>=!~][^"'\s]*)""")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # what `ray up` does (create_or_update_cluster)


class OfflineAWS(NodeProvider):
    """Stands in for AWSNodeProvider's two class-level steps, which need EC2 and credentials."""

    @staticmethod
    def fillout_available_node_types_resources(cluster_config: dict[str, Any]) -> dict[str, Any]:
        raise ConnectionError("offline: no EC2 DescribeInstanceTypes")  # Ray warns and goes on

    @staticmethod
    def bootstrap_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
        check_legacy_fields(cluster_config)  # bootstrap_aws's first step; the rest calls IAM/EC2
        return cluster_config


@pytest.fixture
def bootstrap(monkeypatch):
    """`ray up`'s config pipeline, with the AWS provider's cloud calls replaced (see module doc)."""
    monkeypatch.setitem(providers._NODE_PROVIDERS, "aws", lambda provider_config: OfflineAWS)

    def run(config: dict[str, Any]) -> dict[str, Any]:
        assert config["provider"]["type"] in providers._NODE_PROVIDERS  # `ray up` aborts otherwise
        return commands._bootstrap_config(copy.deepcopy(config), no_config_cache=True)

    return run


def uncommented_keys(text: str) -> list[str]:
    """Key lines with neither an inline comment nor a comment line right above them (no blank line
    between: a comment separated by a blank line belongs to something else)."""
    missing = []
    previous = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            match = KEY_LINE.match(line)
            if match and " #" not in line[match.end() :] and not previous.startswith("#"):
                missing.append(f"line {number}: {stripped}")
        previous = stripped
    return missing


def top_level_keys(text: str) -> list[str]:
    keys = []
    for line in text.splitlines():
        match = KEY_LINE.match(line)
        if match and not match["indent"] and not line.startswith("-"):
            keys.append(match["key"].strip("\"'"))
    return keys


def pyproject_ray_spec() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [m["spec"] for d in deps if (m := RAY_PIN.search(d))]
    return spec


# ---------------------------------------------------------------- Ray's own validation
def test_aws_config_passes_ray_up_validation(bootstrap):
    resolved = bootstrap(load(AWS_FILE))
    # prepare_config merged the setup commands and kept our node types and limits
    assert resolved["head_setup_commands"][: len(resolved["setup_commands"])] == resolved["setup_commands"]
    assert resolved["available_node_types"].keys() == load(AWS_FILE)["available_node_types"].keys()


def test_ray_up_validation_rejects_a_broken_file(bootstrap):
    config = load(AWS_FILE)
    config["max_workers"] = "8"
    with pytest.raises(jsonschema.ValidationError):
        bootstrap(config)


def test_local_config_passes_ray_up_validation(bootstrap):
    raw = load(LOCAL_FILE)
    assert "available_node_types" not in raw and "head_node_type" not in raw  # `ray up` aborts on them
    resolved = bootstrap(raw)
    (node_type,) = resolved["available_node_types"].values()  # prepare_local's single node type
    workers = len(raw["provider"]["worker_ips"])
    # max_workers = number of worker_ips: Ray neither caps it nor leaves listed machines unused
    assert node_type["min_workers"] == node_type["max_workers"] == resolved["max_workers"] == workers


@pytest.mark.parametrize(
    ("breakage", "error"),
    [
        (lambda c: c.update(max_worker=8), jsonschema.ValidationError),  # unknown top-level key
        (lambda c: c.update(max_workers="8"), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["worker.gpu"]["resources"].update(GPU="1"), jsonschema.ValidationError),
        (lambda c: c["available_node_types"]["worker.gpu"].pop("resources"), jsonschema.ValidationError),
        (lambda c: c.update(idle_timeout_minutes=-1), jsonschema.ValidationError),
        (lambda c: c.update(head_node_type="head.gpu"), ValueError),
        (lambda c: c["available_node_types"]["worker.gpu"].update(min_workers=9), ValueError),
    ],
    ids=[
        "unknown-key",
        "max-workers-string",
        "gpu-string",
        "no-resources",
        "negative-timeout",
        "head-type",
        "min-over-max",
    ],
)
def test_ray_validation_rejects_broken_copies(breakage, error):
    config = load(AWS_FILE)
    validate_config(prepare_config(copy.deepcopy(config)))  # the unbroken file passes
    breakage(config)
    with pytest.raises(error):
        validate_config(prepare_config(config))


# ---------------------------------------------------------------- what Ray does not check
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_key_is_commented(path):
    text = path.read_text()
    assert set(top_level_keys(text)) == set(load(path)), "the key scanner missed a top-level key"
    assert uncommented_keys(text) == []


def test_comment_check_catches_a_bare_key():
    text = "# says what\ncluster_name: x\nmax_workers: 2\nprovider:  # inline\n    type: aws\n# far\n\nauth: {}\n"
    assert uncommented_keys(text) == ["line 3: max_workers: 2", "line 5: type: aws", "line 8: auth: {}"]
    assert top_level_keys(text) == ["cluster_name", "max_workers", "provider", "auth"]


def test_aws_node_types():
    config = load(AWS_FILE)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head.get("max_workers", 0) == 0 and not head["resources"].get("GPU")
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu_types, "no GPU worker node type"
    for name, node_type in gpu_types.items():
        assert node_type["resources"]["CPU"] >= 1, name
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= config["max_workers"], name
        assert node_type["node_config"]["InstanceType"]
    assert sum(t.get("min_workers", 0) for t in types.values()) <= config["max_workers"]
    provider = config["provider"]
    assert all(zone.startswith(provider["region"]) for zone in provider["availability_zone"].split(","))


def test_aws_image_is_set_explicitly():
    """An empty ImageId or `latest_dlami` makes bootstrap_aws substitute Ray's built-in AMI (an old
    Ubuntu 18.04 Deep Learning AMI); ours is one placeholder, documented next to it, shared by all."""
    text = AWS_FILE.read_text()
    images = {t["node_config"]["ImageId"] for t in load(AWS_FILE)["available_node_types"].values()}
    (image,) = images
    assert image.lower() not in ("", "latest_dlami")
    assert re.fullmatch(r"ami-[0-9a-f]{8,17}", image) or "REPLACE" in image
    assert "aws ssm get-parameter" in text and "deeplearning/ami" in text


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_setup_installs_this_project(path):
    config = load(path)
    installs = [c for c in config["setup_commands"] if "pip install" in c and "distrain" in c]
    assert installs, "setup_commands must pip-install distrain on every node"
    (remote,) = [r for r, local in config["file_mounts"].items() if (ROOT / local).resolve() == ROOT]
    assert any(remote in c for c in installs), f"install from the synced checkout {remote}"
    assert (ROOT / config["file_mounts"][remote] / "pyproject.toml").is_file()
    # the nodes get the same Ray as pyproject.toml pins (client and cluster versions must match)
    specs = {m["spec"] for c in installs if (m := RAY_PIN.search(c))}
    assert specs == {pyproject_ray_spec()}
    # the local virtual environment and run directories are not uploaded
    assert ".gitignore" in config["rsync_filter"]
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".venv/" in ignored and "runs/" in ignored


def test_aws_head_can_launch_workers():
    """Our head_setup_commands replace Ray's default, which installs boto3 for the autoscaler."""
    assert any("pip install" in c and "boto3" in c for c in load(AWS_FILE)["head_setup_commands"])


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_start_commands(path):
    config = load(path)
    head, worker = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    assert head[0] == worker[0] == "ray stop"
    assert any("ray start --head" in c and "--autoscaling-config=~/ray_bootstrap_config.yaml" in c for c in head)
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in worker)
