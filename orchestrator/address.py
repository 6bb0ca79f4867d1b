"""`--address`: find the Ray cluster it names and check, in seconds, that a Ray cluster listens there.

Left to itself, `ray.init(address=...)` answers an unreachable host:port (or a stale `ray start`
record) only after long GCS retries, with a traceback, and `auto` with no cluster with a
ConnectionError traceback. Here both become one line: `auto` is resolved the way Ray 2.60 does it
for a cluster started with `ray start` (RAY_ADDRESS, then the temp dir's ray_current_cluster file),
and the address found is probed before Ray is asked to join it: a short TCP connect, then an HTTP/2
preface that a gRPC server (Ray's GCS) answers and other servers do not.

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
    """Refuse an address where nothing accepts a TCP connection (in at most `timeout_s`), or where what
    accepts it does not speak gRPC (in at most `timeout_s` more): a web server, a database, a port that
    takes connections and says nothing. Ray's GCS (and the Ray Client server of a ray:// address) is a
    gRPC server, and a gRPC server answers an HTTP/2 connection preface with a SETTINGS frame (RFC 9113
    section 3.4); without this, ray.init takes ~30 s of retries and warnings to give up on such a port."""
    host, port = host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            if _tls():  # the GCS speaks TLS first: a plaintext preface would be refused; leave it to ray.init
                return
            why = _http2_answer(conn, timeout_s)
            if why is None:
                return
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
        raise ResourceError(
            f"no Ray cluster answers at {address} ({why} after at most {timeout_s:g}s); "
            "check the address and that the cluster is up (`ray status`), or drop --address to run on a local Ray"
        ) from None
    raise ResourceError(
        f"no Ray cluster answers at {address}: something accepts connections there but does not speak Ray's "
        f"protocol ({why}); check the address and port (`ray status` on the head node prints it), or drop "
        "--address to run on a local Ray"
    )


# The client's HTTP/2 connection preface, then its (empty) SETTINGS frame: 3 bytes length, type 4, flags 0,
# stream 0. A server's own preface is a SETTINGS frame (type 4) on stream 0, sent before anything else.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
FRAME_HEADER = 9
SETTINGS = 4


def _http2_answer(conn: socket.socket, timeout_s: float) -> str | None:
    """None if the peer answers the HTTP/2 preface with a SETTINGS frame; else what it did instead."""
    conn.settimeout(timeout_s)
    try:
        conn.sendall(HTTP2_PREFACE)
        head = b""
        while len(head) < FRAME_HEADER:
            chunk = conn.recv(FRAME_HEADER - len(head))
            if not chunk:
                break
            head += chunk
    except TimeoutError:
        return f"it said nothing for {timeout_s:g}s"
    except OSError as e:
        return f"it dropped the connection: {(e.strerror or type(e).__name__).lower()}"
    if len(head) == FRAME_HEADER and head[3] == SETTINGS and int.from_bytes(head[5:9], "big") & 0x7FFFFFFF == 0:
        return None
    if not head:
        return "it closed the connection without a word"
    shown = "".join(chr(b) if 32 <= b < 127 else "." for b in head)
    return f"it answered {shown!r}"


def _tls() -> bool:
    """Ray's own switch for TLS between its processes (ray._private.grpc_utils reads it the same way)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def reachable(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """`--address` resolved and probed: what to pass to ray.init."""
    if address == "local":  # ray.init's own word for "start a fresh local Ray": nothing to reach
        return address
    found = resolve(address)
    probe(found, timeout_s)
    return found
