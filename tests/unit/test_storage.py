"""--storage: the run directory copied to a pyarrow filesystem (a real S3 server on localhost, and a
local path) only where it changed, and URIs downloaded for reading (no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyarrow import fs

from distrain.config import RunConfig
from distrain.errors import ConfigError
from distrain.orchestrator.callbacks import RunInfo
from distrain.orchestrator.storage import (
    StorageSync,
    download,
    filesystem,
    localize,
    parent_uri,
    upload_files,
)
from tests.s3_server import s3_bucket  # noqa: F401 - the fixture


def remote_files(uri: str) -> dict[str, bytes]:
    filesystem_, base = filesystem(uri)
    infos = filesystem_.get_file_info(fs.FileSelector(base, recursive=True))
    out = {}
    for info in infos:
        if info.type == fs.FileType.File:
            with filesystem_.open_input_stream(info.path) as f:
                out[info.path[len(base.rstrip("/")) + 1 :]] = f.read()
    return out


def make_run(root: Path) -> Path:
    run_dir = root / "runs" / "r1"
    (run_dir / "checkpoints" / "state-00000002").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("lr: 0.1\n")
    (run_dir / "checkpoints" / "step-00000002.pt").write_bytes(b"ckpt")
    (run_dir / "checkpoints" / "latest.json").write_text(json.dumps({"name": "step-00000002.pt"}))
    (run_dir / "checkpoints" / "state-00000002" / "__0_0.distcp").write_bytes(b"shard0")
    (run_dir / "checkpoints" / "state-00000002" / "__1_0.distcp").write_bytes(b"shard1")
    (run_dir / "checkpoints" / "state-00000002" / ".metadata").write_bytes(b"meta")
    return run_dir


@pytest.mark.parametrize("where", ["s3", "local"])
def test_the_run_directory_is_synced_where_it_changed_and_downloaded_back(tmp_path, s3_bucket, where):  # noqa: F811
    storage = f"{s3_bucket}/prefix" if where == "s3" else str(tmp_path / "shared")
    run_dir = make_run(tmp_path)
    sync = StorageSync(storage, sharded=True)
    info = RunInfo(run_dir, RunConfig(), total_steps=4, steps_per_epoch=2, start_step=0, num_params=1, target=None)
    sync.on_run_start(info)
    expected = {
        "config.yaml": b"lr: 0.1\n",
        "checkpoints/step-00000002.pt": b"ckpt",
        "checkpoints/latest.json": b'{"name": "step-00000002.pt"}',
    }  # the shards are the workers' to copy
    assert remote_files(f"{storage}/r1") == expected
    assert sync.uploader.sync() == 0  # nothing changed: nothing copied
    (run_dir / "summary.json").write_text('{"status": "completed"}')
    sync.on_run_end({"status": "completed"})
    assert remote_files(f"{storage}/r1") == expected | {"summary.json": b'{"status": "completed"}'}
    # each worker copies its own shards (rank 1's file here), as AsyncSaver's upload does
    shards = run_dir / "checkpoints" / "state-00000002"
    upload_files(run_dir, storage, [shards / "__1_0.distcp"])
    assert remote_files(f"{storage}/r1")["checkpoints/state-00000002/__1_0.distcp"] == b"shard1"

    local = Path(localize(f"{storage}/r1", "--resume")) if where == "s3" else download(f"file://{storage}/r1", "x")
    assert local.name == "r1" and (local / "summary.json").read_text() == '{"status": "completed"}'
    assert (local / "checkpoints" / "state-00000002" / "__1_0.distcp").read_bytes() == b"shard1"
    assert localize(str(run_dir), "report") == str(run_dir)  # a path is read where it is


def test_a_checkpoint_uri_comes_down_with_its_shards_folder(tmp_path, s3_bucket):  # noqa: F811
    import torch

    from distrain.orchestrator.checkpoint import FORMAT

    run_dir = make_run(tmp_path)
    torch.save({"format": FORMAT, "sharded": {"dir": "state-00000002"}}, run_dir / "checkpoints" / "step-00000002.pt")
    shards = run_dir / "checkpoints" / "state-00000002"
    upload_files(run_dir, s3_bucket, [run_dir / "checkpoints" / "step-00000002.pt", *shards.iterdir()])
    local = Path(localize(f"{s3_bucket}/r1/checkpoints/step-00000002.pt", "--init-from"))
    assert local.is_file() and sorted(p.name for p in (local.parent / "state-00000002").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip


def test_uris_that_cannot_be_used_are_refused_in_one_line(tmp_path, s3_bucket):  # noqa: F811
    assert parent_uri("s3://b/runs/r1/") == "s3://b/runs" and parent_uri("s3://b/r?x=1") == "s3://b?x=1"
    with pytest.raises(ConfigError, match="^--storage 'nosuch://x/y': "):
        filesystem("nosuch://x/y")
    with pytest.raises(ConfigError, match="nothing there"):
        download(f"{s3_bucket}/no-such-run", "--resume")


def test_a_failed_copy_at_a_checkpoint_is_made_up_later_and_raised_only_at_the_end(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path)
    storage = str(tmp_path / "shared")
    sync = StorageSync(storage, sharded=False)
    info = RunInfo(run_dir, RunConfig(), total_steps=4, steps_per_epoch=2, start_step=0, num_params=1, target=None)
    sync.on_run_start(info)
    real = sync.uploader.sync

    def unreachable(only=None):
        raise OSError("connection refused")

    (run_dir / "checkpoints" / "step-00000004.pt").write_bytes(b"ckpt4")
    monkeypatch.setattr(sync.uploader, "sync", unreachable)
    sync.on_checkpoint(run_dir / "checkpoints" / "step-00000004.pt", 4)  # the run goes on
    with pytest.raises(OSError, match="connection refused"):
        sync.on_run_end({"status": "completed"})
    monkeypatch.setattr(sync.uploader, "sync", real)
    sync.on_run_end({"status": "completed"})
    assert remote_files(f"{storage}/r1")["checkpoints/step-00000004.pt"] == b"ckpt4"
