"""`--address`: find the Ray cluster it names and check, in a second, that something listens there.

Left to itself, `ray.init(address=...)` answers an unreachable host:port (or a stale `ray start`
record) only after long GCS retries, with a traceback, and `auto` with no cluster with a
ConnectionError traceback. Here both become one line: `auto` is resolved the way Ray 2.60 does it
for a cluster started with `ray start` (RAY_ADDRESS, then the temp dir's ray_current_cluster file),
and the address found is probed with a short TCP connect before Ray is asked to join it.

Ray's legacy fallback for `auto`, joining any GCS process found by `ps` on this machine, is left
out on purpose: it can attach a run to some other session's private `ray.init()` cluster.
"""

from __future__ import annotations

import os
import socket

from distrain.errors import ResourceError

PROBE_TIMEOUT_S = 3.0
CLIENT_SCHEME = "ray://"  # Ray Client addresses keep their scheme; the probe goes to their host:port


def _recorded_cluster() -> str | None:
    """The address the last `ray start` on this machine recorded (None: none, or it was stopped)."""
    from ray._private.utils import read_ray_address  # Ray's own lookup (honours its temp-dir settings)

    return read_ray_address() or None


def resolve(address: str) -> str:
    """The concrete address `--address` names: `auto` looked up, anything else as given (checked)."""
    if address == "auto":
        found = os.environ.get("RAY_ADDRESS") or _recorded_cluster()
        if not found:
            raise ResourceError(
                "--address auto found no Ray cluster (RAY_ADDRESS is unset and no `ray start` cluster runs "
                "on this machine); start one with `ray start --head`, or drop --address to run on a local Ray"
            )
        address = found
    host_port(address)
    return address


def host_port(address: str) -> tuple[str, int]:
    """HOST:PORT (or ray://HOST:PORT) split into its parts; anything else is refused."""
    host, sep, port = address.removeprefix(CLIENT_SCHEME).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ResourceError(f"--address {address!r} must be auto or HOST:PORT (e.g. 10.0.0.1:6379)")
    return host.strip("[]"), int(port)


def probe(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Refuse, in at most `timeout_s`, an address where nothing accepts a TCP connection."""
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
    raise ResourceError(
        f"no Ray cluster answers at {address} ({why} after at most {timeout_s:g}s); "
        "check the address and that the cluster is up (`ray status`), or drop --address to run on a local Ray"
    )


def reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """`--address` resolved and probed: what to pass to ray.init."""
    if address == "local":  # ray.init's own word for "start a fresh local Ray": nothing to reach
        return address
    found = resolve(address)
    probe(found, timeout_s)
    return found
