"""The processes of a local Ray that a distrain driver started and that outlived that driver.

After a `kill -9` of the driver no handler runs: Ray's GCS and raylet die with it (the kernel's
parent-death signal), but what the raylet started (dashboard and runtime-env agents, workers) can
be left behind, re-parented to init. So a driver that starts a local Ray writes MARKER into that
Ray's session directory (its PID and start time) and removes it when it stops Ray; the next local
start (`stop_orphaned`) looks for markers whose driver is gone and stops that session's processes:
those with a file open in the session directory (every Ray process keeps its logs there) or naming
it on their command line. A session without a marker (Ray started by anything else) or whose driver
still runs is never touched; PID and start time together tell a reused PID from the driver.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil

MARKER = "distrain-driver.json"
GRACE_S = 3.0  # SIGTERM first; what is still there after this gets SIGKILL


def default_temp_dir() -> Path:
    """Where a local Ray keeps its session directories (Ray's own rule: RAY_TMPDIR, TMPDIR, /tmp)."""
    try:
        from ray._common.utils import get_default_ray_temp_dir

        return Path(get_default_ray_temp_dir())
    except ImportError:  # pragma: no cover - another Ray layout
        return Path(os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp") / "ray"


def record(session_dir: Path, pid: int | None = None) -> None:
    """Mark `session_dir` as started by this process (or `pid`)."""
    proc = psutil.Process(pid or os.getpid())
    marker = {"pid": proc.pid, "create_time": proc.create_time()}
    (session_dir / MARKER).write_text(json.dumps(marker) + "\n")


def forget(session_dir: Path) -> None:
    """Ray was stopped properly: nothing for a later start to look for."""
    (session_dir / MARKER).unlink(missing_ok=True)


def driver_alive(marker: dict) -> bool:
    try:
        return abs(psutil.Process(int(marker["pid"])).create_time() - float(marker["create_time"])) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, ValueError, TypeError):
        return False


def orphaned_sessions(temp_dir: Path | None = None) -> list[Path]:
    """Session directories with a marker whose driver is gone."""
    found = []
    for path in sorted((temp_dir or default_temp_dir()).glob(f"session_*/{MARKER}")):
        if path.parent.is_symlink():  # session_latest: the same session again
            continue
        try:
            marker = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not driver_alive(marker):
            found.append(path.parent)
    return found


def session_processes(session_dirs: list[Path]) -> list[psutil.Process]:
    """This user's processes that belong to one of `session_dirs` (a file open there, or named on the
    command line)."""
    roots = [os.path.realpath(d) for d in session_dirs]
    me, uid = os.getpid(), os.getuid()
    found = []
    for proc in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            cmdline = " ".join(proc.info["cmdline"] or ())
            if any(root in cmdline for root in roots) or any(
                f.path.startswith(root + os.sep) for f in proc.open_files() for root in roots
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stop(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def stop_orphaned(temp_dir: Path | None = None) -> int:
    """Stop the leftovers of every local Ray an earlier distrain driver started and did not stop;
    returns how many processes were stopped."""
    sessions = orphaned_sessions(temp_dir)
    if not sessions:
        return 0
    procs = session_processes(sessions)
    stop(procs)
    for session in sessions:
        forget(session)
    return len(procs)
