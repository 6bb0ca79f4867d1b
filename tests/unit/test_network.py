"""The emulated network's pieces without Ray: rates with units, and the link's timing rule."""

from __future__ import annotations

import pytest

from distrain.errors import ConfigError
from distrain.strategies.network import Link
from distrain.units import parse_rate, rate_text


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [("100mbit", 12.5e6), ("25gbit", 3.125e9), ("12.5MB/s", 12.5e6), ("1GiB/s", 2**30), ("100 Mbit", 12.5e6),
     ("1e3kbit", 125e3), ("8Mbps", 1e6), ("0.5gb/s", 0.5e9)],
)  # fmt: skip
def test_rates_parse_with_their_units(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "message"),
    [("fast", "is not a rate"), ("100", "is not a rate"), ("100mb", "is not a rate"), ("-5mbit", "positive"),
     ("0mbit", "positive"), ("", "is not a rate")],
)  # fmt: skip
def test_bad_rates_are_one_line(text, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_rate(text)
    assert "\n" not in str(e.value) and "--comm-bandwidth" in str(e.value)


def test_rate_text_reads_as_link_speeds():
    assert rate_text(12.5e6) == "100 Mbit/s" and rate_text(3.125e9) == "25 Gbit/s"


def test_transfers_queue_on_the_link_and_overlap_what_runs_meanwhile():
    link = Link(latency_s=0.01, bytes_per_s=1e6)
    assert link.transfer_s(20_000) == pytest.approx(0.03)
    t = 100.0
    assert link.reserve(20_000, start=t) == pytest.approx(t + 0.03)
    # launched while the first is on the wire: it waits for the link, then takes its own time
    assert link.reserve(10_000, start=t + 0.01) == pytest.approx(t + 0.03 + 0.02)
    # launched after the link went idle: from its own launch
    assert link.reserve(0, start=t + 1) == pytest.approx(t + 1.01)
    assert not Link().emulated and Link(bytes_per_s=1.0).emulated and Link(latency_s=0.001).emulated


def test_hold_until_waits_only_for_what_is_outstanding(monkeypatch):
    """On a fake clock: a transfer of 50 ms launched at 0, the worker busy until 30 ms, holds 20 ms more."""
    import distrain.strategies.network as network

    now = [0.0]
    slept: list[float] = []
    monkeypatch.setattr(network.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(network.time, "sleep", lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    link = Link(latency_s=0.05)
    done = link.reserve(0)
    now[0] = 0.03  # the worker computes while the transfer is on the wire
    link.hold_until(done)
    assert slept == [pytest.approx(0.02)] and now[0] == pytest.approx(0.05)
    link.hold_until(done)  # already past: no wait
    assert len(slept) == 1
