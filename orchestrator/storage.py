"""`--storage URI`: a run kept on shared storage (a local path, or a pyarrow filesystem URI: s3://bucket/prefix).

The run directory is written locally as always (the staging copy) and copied to URI/<run id>/ with
pyarrow.fs: at each checkpoint and at the run's end (`StorageSync`, the driver's last callback), only the
files that changed since the last copy, and `checkpoints/latest.json` last, so the copy on the storage
never names a checkpoint it does not hold yet. Workers of a sharded run on other nodes copy their own
checkpoint shards (`upload_files`). Reading goes the other way: a URI given to --resume, --init-from,
`report` or `load_model` is downloaded into a local cache first (`localize`), then read as a path.

pyarrow.fs finds S3 credentials, region and endpoint in the usual AWS_* variables (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, ...); `aws_environment` passes them on to the
workers (the Ray runtime_env). Ray Train's own StorageContext does the same for Ray Train, but is private.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError, DistrainError
from distrain.orchestrator.callbacks import Callback, RunInfo

CACHE_VAR = "DISTRAIN_STORAGE_CACHE"  # where URIs are downloaded (default ~/.cache/distrain/storage)
LAST = "latest.json"  # copied after everything else: it names the newest complete checkpoint
CHECKPOINTS = "checkpoints"  # orchestrator/checkpoint.py's folder (not imported: that loads torch)
SHARDS_PREFIX = "state-"  # trainers/sharded_checkpoint.py's shard folders


def is_uri(text: str | Path) -> bool:
    """Whether `text` names a pyarrow filesystem URI (s3://..., gs://..., file://...) rather than a path."""
    return "://" in str(text)


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) of a URI or a local path (made absolute)."""
    from pyarrow import fs

    target = uri if is_uri(uri) else str(Path(uri).expanduser().resolve())
    try:
        return fs.FileSystem.from_uri(target)
    except (ValueError, OSError) as e:  # an unknown scheme, a malformed URI, a filesystem pyarrow lacks
        raise ConfigError(f"--storage {uri!r}: {e}") from None


def join(uri: str, name: str) -> str:
    """`uri`/`name` (a URI keeps its query string, e.g. ?endpoint_override=...)."""
    base, _, query = uri.partition("?")
    return f"{base.rstrip('/')}/{name}" + (f"?{query}" if query else "")


def parent_uri(uri: str) -> str:
    """The URI of the folder holding what `uri` names (a run's: its --storage)."""
    base, _, query = uri.partition("?")
    return base.rstrip("/").rsplit("/", 1)[0] + (f"?{query}" if query else "")


def check_storage(uri: str) -> None:
    """Before the run starts: the storage can be reached and written (one line, not a traceback later)."""
    filesystem_, path = filesystem(uri)
    try:
        filesystem_.create_dir(path, recursive=True)
    except OSError as e:
        raise ConfigError(f"--storage {uri!r} cannot be written: {e}") from None


class Uploader:
    """Copies a local folder's files to one under a URI, each only when its size or mtime changed."""

    def __init__(self, local: Path, uri: str, skip: Callable[[str], bool] | None = None) -> None:
        self.local, self.uri, self.skip = local, uri, skip
        self.fs, self.base = filesystem(uri)
        self.sent: dict[str, tuple[int, int]] = {}

    def sync(self, only: list[Path] | None = None) -> int:
        """Copy what changed (of `only`, or of the whole folder); returns the files copied."""
        from pyarrow import fs

        files = only if only is not None else [p for p in self.local.rglob("*") if p.is_file()]
        files = sorted(files, key=lambda p: p.name == LAST)  # latest.json last
        local = fs.LocalFileSystem()
        copied = 0
        for path in files:
            try:
                stat = path.stat()
            except FileNotFoundError:  # a temporary file renamed meanwhile (atomic writes)
                continue
            rel = path.relative_to(self.local).as_posix()
            mark = (stat.st_size, stat.st_mtime_ns)
            if self.sent.get(rel) == mark or ".tmp" in path.name or (self.skip is not None and self.skip(rel)):
                continue
            target = f"{self.base.rstrip('/')}/{rel}"
            self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            fs.copy_files(str(path), target, source_filesystem=local, destination_filesystem=self.fs)
            self.sent[rel] = mark
            copied += 1
        return copied


class StorageSync(Callback):
    """The driver's copy of the run directory to --storage: at each checkpoint and at the end. A sharded
    run's shard folders (checkpoints/state-*/) are left to the workers that write them (`upload_files`):
    on a cluster each node holds only its own workers' shards."""

    def __init__(self, uri: str, sharded: bool) -> None:
        self.uri, self.sharded = uri, sharded
        self.uploader: Uploader | None = None

    def on_run_start(self, info: RunInfo) -> None:
        skip = (lambda rel: rel.startswith(f"{CHECKPOINTS}/{SHARDS_PREFIX}")) if self.sharded else None
        self.uploader = Uploader(info.run_dir, join(self.uri, info.run_dir.name), skip)
        self.uploader.sync()  # config.yaml from the start: the run is visible (and resumable) there

    def on_checkpoint(self, path: Path, step: int) -> None:
        if self.uploader is not None:
            try:
                self.uploader.sync()
            except OSError:  # the storage out of reach for now: the next copy sends what this one missed,
                pass  # and the one at the end raises (training goes on meanwhile, staged locally)

    def on_run_end(self, summary: dict[str, Any]) -> None:
        if self.uploader is not None:
            self.uploader.sync()


def upload_files(run_dir: Path, uri: str, files: list[Path]) -> None:
    """A worker's own files of the run directory (its checkpoint shards) to the run's place on `uri`."""
    Uploader(run_dir, join(uri, run_dir.name)).sync(files)


# ---------------------------------------------------------------------- reading
def cache_root() -> Path:
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "distrain" / "storage")


def local_copy_of(uri: str) -> Path:
    """Where `uri` is downloaded: the cache, then scheme/bucket/path (so a run keeps its own name)."""
    scheme, _, rest = uri.partition("?")[0].partition("://")
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
    return cache_root().joinpath(scheme or "file", *parts)


def download(uri: str, what: str) -> Path:
    """A fresh local copy of the file or folder `uri` names (`what`: the flag or function, for messages)."""
    from pyarrow import fs

    filesystem_, path = filesystem(uri)
    try:
        info = filesystem_.get_file_info(path)
    except OSError as e:
        raise DistrainError(f"{what} {uri!r}: {e}") from None
    if info.type == fs.FileType.NotFound:
        raise ConfigError(f"{what} {uri!r}: nothing there")
    target = local_copy_of(uri)
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    local = fs.LocalFileSystem()
    if info.type == fs.FileType.Directory:
        target.mkdir()
        fs.copy_files(path, str(target), source_filesystem=filesystem_, destination_filesystem=local)
    else:
        fs.copy_files(path, str(target), source_filesystem=filesystem_, destination_filesystem=local)
        _with_shards(uri, target)
    return target


def _with_shards(uri: str, file: Path) -> None:
    """A sharded run's checkpoint file names its shards folder beside it: that comes down too."""
    if file.suffix != ".pt":
        return
    from distrain.orchestrator.checkpoint import load_checkpoint

    try:
        ref = load_checkpoint(file).get("sharded")
    except DistrainError:
        return  # not a checkpoint: its reader says so
    if ref is not None:
        base, _, query = uri.partition("?")
        download(join(base.rsplit("/", 1)[0] + ("?" + query if query else ""), ref["dir"]), "the shards of")


def localize(text: str | Path, what: str) -> str | Path:
    """`text` itself when it is a path; a URI's local copy (downloaded now) otherwise."""
    return str(download(str(text), what)) if is_uri(text) else text


def aws_environment() -> dict[str, str]:
    """The AWS_* variables of this process, for the workers' environment (credentials, region, endpoint)."""
    return {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
