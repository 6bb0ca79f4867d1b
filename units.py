"""Quantities written with units on the command line: data rates (`--comm-bandwidth`, and the planner's
`--bandwidth`), sizes (`--worker-memory`), and amounts of bytes as summaries print them. No torch, no Ray:
the CLI validates with it before anything starts."""

from __future__ import annotations

import math
import re

from distrain.errors import ConfigError

# unit (lower case) -> bytes per second. Network rates in bits (decimal, as links are sold), storage-style
# rates in bytes (decimal, or binary with "i").
RATE_UNITS = {
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8,
    "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
    "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
}  # fmt: skip
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]+)\s*", re.IGNORECASE)


def parse_rate(text: str, flag: str = "--comm-bandwidth") -> float:
    """ "100mbit", "25gbit", "12.5MB/s", "1GiB/s" -> bytes per second (> 0). "MB/s" means bytes and "mbit"
    bits, whatever the case; a bare number is refused (bits or bytes?)."""
    if str(text).strip().startswith("-"):
        raise ConfigError(f"{flag} must be a positive rate, got {text!r}")
    match = _RATE.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in RATE_UNITS:
        raise ConfigError(f"{flag} {text!r} is not a rate: write a number and a unit, e.g. 100mbit, 25gbit or 12.5MB/s")
    rate = float(match.group(1)) * RATE_UNITS[unit]
    if not (rate > 0 and math.isfinite(rate)):
        raise ConfigError(f"{flag} must be a positive rate, got {text!r}")
    return rate


def parse_bytes(text: str) -> int:
    """'20GiB', '512MiB', '2e10' -> bytes (--worker-memory, the memory overrides); ValueError if not a size."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit):
            return int(float(t.removesuffix(unit)) * factor)
    return int(float(t))


def rate_text(bytes_per_s: float) -> str:
    """A rate as people write link speeds: 12.5 MB/s -> "100 Mbit/s"."""
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def size_text(nbytes: float) -> str:
    """An amount of bytes as people read it, in decimal units: 680016 -> "680.0 kB", 12.3e6 -> "12.3 MB"."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
FLOPS_UNITS = {"flops": 1.0, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15}
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zµ/]*)\s*", re.IGNORECASE)


def _amount(text: str, flag: str, units: dict[str, float], example: str) -> float:
    match = _AMOUNT.fullmatch(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in units:
        raise ConfigError(f"{flag} {text!r} is not understood: write a number and a unit, e.g. {example}")
    value = float(match.group(1)) * units[unit]
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag} must be positive, got {text!r}")
    return value


def parse_duration(text: str, flag: str = "--latency") -> float:
    """ "50us", "0.2ms", "1s" -> seconds (> 0)."""
    return _amount(text, flag, DURATION_UNITS, "50us or 0.2ms")


def parse_flops(text: str, flag: str = "--gpu-flops") -> float:
    """ "300tflops", "5e14flops" -> FLOP/s (> 0)."""
    return _amount(text, flag, FLOPS_UNITS, "300tflops")


def parse_worker_counts(text: str, flag: str = "--workers") -> list[int]:
    """The comma list where several worker counts are compared (`plan`, `tune`): "1,2,4,64" -> [1, 2, 4, 64],
    each a positive integer, in the order given, repeats dropped. (A single `N` is a run's count; `MIN..MAX`,
    an elastic run's range, is parsed where runs read --workers.)"""
    counts: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(f"{flag} {text!r} must be a comma list of positive worker counts, e.g. 1,2,4,64")
        if int(part) not in counts:
            counts.append(int(part))
    return counts
