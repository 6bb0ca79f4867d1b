"""The channel (strategies/channel.py) on its own, one rank, no Ray and no process group: named streams
under the run's codec or float32, the byte accounting a row gets, and the codec state a checkpoint
carries (a resumed channel goes on with the residuals of an unbroken one; a checkpoint without them
starts them at zero)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from distrain.compression import parse_codec
from distrain.config import RunConfig
from distrain.strategies.base import CommStats, StrategyContext
from distrain.strategies.channel import Channel, Traffic

N = 300


def channel(compress: str | None = "int8") -> Channel:
    ch = Channel(RunConfig(compress=compress), StrategyContext(rank=0, world_size=1, device="cpu"))
    ch.group = SimpleNamespace(world_size=1)  # one rank: nothing goes to a peer, no process group needed
    return ch


def inputs(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(N, generator=g) for _ in range(steps)]


def test_a_stream_goes_through_the_codec_and_its_exact_tail_does_not():
    ch, x = channel(), inputs(1)[0]
    buffer = x.clone()
    traffic = ch.all_reduce("params", buffer, exact_tail=20)
    codec = parse_codec("int8").build()
    assert torch.equal(buffer[:-20], codec.decode(codec.encode(x[:-20])))  # one rank: the mean is its own decode
    assert torch.equal(buffer[-20:], x[-20:])  # float32, untouched
    assert torch.allclose(ch.streams["params"].reducer.residual, x[:-20] - buffer[:-20])
    assert traffic.sent == 0 and traffic.uncompressed == 0  # one rank puts nothing on the wire
    exact = x.clone()
    ch.open("state", exact=True)
    ch.all_reduce("state", exact)
    assert torch.equal(exact, x) and ch.streams["state"].reducer is None and ch.codec_of("state") is None
    summed = x.clone()
    assert ch.all_reduce("weights", summed, op="sum").uncompressed is None  # a sum travels float32


def test_a_row_counts_compressed_and_float32_transfers_together():
    """local SGD's round: θ's change under the codec, then its state in float32 (bytes_uncompressed: both)."""
    row = CommStats(nonfinite=True).add(Traffic(0.5, 100, 100, 400)).add(Traffic(0.25, 30, 30))
    assert (row.seconds, row.bytes_sent, row.bytes_received, row.bytes_uncompressed) == (0.75, 130, 130, 430)
    assert row.nonfinite is True
    plain = CommStats().add(Traffic(0.1, 8, 8))
    assert plain.bytes_uncompressed is None  # no codec ran: the column stays empty
    assert (Traffic(1, 2, 3) + Traffic(1, 2, 3, 9)).uncompressed == 11


def run(ch: Channel, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    outs = []
    for x in xs:
        buffer = x.clone()
        ch.all_reduce("grads", buffer)
        outs.append(buffer)
    return outs


def test_a_resumed_channel_goes_on_with_the_unbroken_residuals():
    xs = inputs(6)
    unbroken = channel("topk:0.05")
    expected = run(unbroken, xs)
    first = channel("topk:0.05")
    run(first, xs[:3])
    state = first.state_dict()
    assert state["grads"]["reducer"]["residual"].abs().sum() > 0  # something to carry over
    resumed = channel("topk:0.05")
    resumed.load_state_dict(state)  # before the stream exists: taken when it is first used
    assert resumed.state_dict() == state  # a checkpoint taken before the first use keeps it
    again = run(resumed, xs[3:])
    for got, want in zip(again, expected[3:], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(resumed.streams["grads"].reducer.residual, unbroken.streams["grads"].reducer.residual)


def test_powersgd_s_warm_start_is_carried_too():
    shapes = [torch.Size([20, 15])]
    xs = inputs(4)
    unbroken, first, resumed = channel("powersgd:2"), channel("powersgd:2"), channel("powersgd:2")
    for ch in (unbroken, first, resumed):
        ch.open("grads", shapes=shapes)
    expected = run(unbroken, xs)
    run(first, xs[:2])
    run(resumed, xs[:1])  # a stream already in use takes the state at once
    resumed.load_state_dict(first.state_dict())
    for got, want in zip(run(resumed, xs[2:]), expected[2:], strict=True):
        assert torch.equal(got, want)


def test_a_checkpoint_without_codec_state_starts_the_residuals_at_zero():
    ch = channel()
    ch.load_state_dict({})  # what a checkpoint written before the channel held
    x = inputs(1)[0]
    fresh = channel()
    assert torch.equal(run(ch, [x])[0], run(fresh, [x])[0])
    assert torch.equal(ch.streams["grads"].reducer.residual, fresh.streams["grads"].reducer.residual)
    assert channel(None).state_dict() == {}  # no codec: nothing to keep


@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.05"])
def test_every_codec_with_error_feedback_round_trips_its_residual_through_a_checkpoint(tmp_path, codec):
    """What a checkpoint file carries (torch.save, loaded weights-only as checkpoints are) puts a fresh
    channel where the unbroken one is: the same outputs from then on, the same residual at the end."""
    xs = inputs(5)
    unbroken = channel(codec)
    expected = run(unbroken, xs)
    first = channel(codec)
    run(first, xs[:2])
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = channel(codec)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    for got, want in zip(run(resumed, xs[2:]), expected[2:], strict=True):
        assert torch.equal(got, want)
    zero = channel(codec)  # the same inputs without the state: differs, so the state is what carried it
    assert not all(torch.equal(a, b) for a, b in zip(run(zero, xs[2:]), expected[2:], strict=True))
    assert torch.equal(resumed.streams["grads"].reducer.residual, unbroken.streams["grads"].reducer.residual)


class FakeShards:
    """The PS client's push_pull, recording what each push carried (no Ray)."""

    def __init__(self) -> None:
        self.pushed: list[Any] = []

    def push_pull(self, clock, payload, lr, params):
        self.pushed.append(payload)
        return SimpleNamespace(seconds=0.0)


def ps_channel(codec: str) -> Channel:
    ctx = StrategyContext(rank=1, world_size=2, device="cpu", ps_bounds=((0, 120), (120, N)))
    ch = Channel(RunConfig(compress=codec), ctx)
    ch._ps = FakeShards()
    return ch


def push(ch: Channel, xs: list[torch.Tensor]) -> list[Any]:
    import numpy as np

    for clock, x in enumerate(xs):
        ch.push_pull("grads", clock, x.clone(), 0.1, np.zeros(N, dtype=np.float32))
    return ch._ps.pushed


@pytest.mark.parametrize("codec", ["int8", "sign", "topk:0.05"])
def test_the_per_shard_residuals_of_pushes_round_trip_too(tmp_path, codec):
    xs = inputs(5)
    expected = push(ps_channel(codec), xs)
    first = ps_channel(codec)
    push(first, xs[:2])
    state = first.state_dict()
    assert [r.numel() for r in state["grads"]["shards"]] == [120, N - 120]  # one residual per shard slice
    torch.save(state, tmp_path / "state.pt")
    resumed = ps_channel(codec)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    decode = parse_codec(codec).build().decode

    def sent(pushes: list[Any]) -> list[torch.Tensor]:  # what the shards would apply, slice after slice
        return [torch.cat([decode(e) for _, e in p]) for p in pushes]

    want = sent(expected[2:])
    assert all(torch.equal(a, b) for a, b in zip(sent(push(resumed, xs[2:])), want, strict=True))
    fresh = sent(push(ps_channel(codec), xs[2:]))  # without the state: other pushes
    assert not all(torch.equal(a, b) for a, b in zip(fresh, want, strict=True))
