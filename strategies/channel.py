"""The channel: every transfer a strategy makes, between workers and to parameter-server shards.

A strategy gets its channel ready-made (`Strategy.channel`, built from the run's config and the
worker's context) and says only *what* it sends, on a named stream ("grads", "pseudo_grads",
"params", ...): all-reduce (mean or sum), broadcast, all-gather, reduce-scatter between the workers,
push and pull to the shards. What the channel does once, for every strategy (plugins included):
- the run's codec (`--compress`, distrain/compression) on every stream not declared `exact`, with
  error feedback kept per stream (`compressed_collective.CompressedAllReduce` between workers, one
  `ErrorFeedback` per shard slice towards the shards);
- the emulated link (`--comm-delay-ms`, `--comm-bandwidth`, network.py): one per worker, every transfer
  charged on it;
- the accounting: each call returns its `Traffic` (seconds, bytes sent and received, and what the
  bytes would have been in float32 where a codec ran), which `CommStats.add` puts on the step's row;
- the codec state (residuals, PowerSGD's warm start) for checkpoints: `state_dict`/`load_state_dict`.

Streams that must stay float32 (a broadcast of initial weights, averaged optimizer state, a weight
count) say so with `exact=True` (or an `exact_tail`), never by branching in the strategy. Broadcasts
are never charged: they happen at set-up and re-forms, before any step row.

The collective group itself (collective.py: gloo/NCCL, the TCP rendezvous, the overlapped bucketed
all-reduce) and the PS client (ps_client.py) are the channel's internals; strategies do not import them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distrain.compression.spec import codec_of
from distrain.strategies.network import Link

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch

    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.collective import CollectiveGroup
    from distrain.strategies.compressed_collective import CompressedAllReduce
    from distrain.strategies.ps_client import PSClient, PushPullResult

# A PS wait gives up after PS_WAIT_FACTOR x --hang-timeout-s + PS_WAIT_MARGIN_S: later than the driver's
# hang detection (1x) plus the start of a replacement, whose first push releases whoever waits.
PS_WAIT_FACTOR = 3
PS_WAIT_MARGIN_S = 30.0


@dataclass
class Traffic:
    """What one transfer (or several) cost: seconds waited, bytes this worker put on the wire and took
    off it, and `uncompressed`: what `sent` would have been in float32, where a codec ran (None: none did)."""

    seconds: float = 0.0
    sent: int = 0
    received: int = 0
    uncompressed: int | None = None

    def __add__(self, other: Traffic) -> Traffic:
        raw = None
        if self.uncompressed is not None or other.uncompressed is not None:
            raw = _raw(self) + _raw(other)
        return Traffic(self.seconds + other.seconds, self.sent + other.sent, self.received + other.received, raw)


def _raw(t: Traffic) -> int:
    return t.sent if t.uncompressed is None else t.uncompressed


@dataclass
class Stream:
    """One named stream: its tensors' shapes (PowerSGD needs whole matrices), whether it stays float32,
    the group it is reduced over (a cut replica's parts cross the replicas only), and, once it carried
    something under a codec, its compressed all-reduce (residual, warm start)."""

    name: str
    shapes: list[Any] | None = None
    exact: bool = False
    group: Any = None  # the process group it reduces over (None: every worker of the channel's group)
    reducer: CompressedAllReduce | None = None
    shard_feedback: list[Any] = field(default_factory=list)  # towards the shards: one residual per slice


class Pending:
    """An all-reduce launched in the background (`Channel.all_reduce_async`): its launch's `traffic`
    (bytes, and the codec's time where one ran, blocking), and `wait()` for the result in place."""

    def __init__(self, traffic: Traffic, work: Any = None, deadline: float = 0.0, divide: int = 1, tensor: Any = None):
        self.traffic = traffic
        self._work, self._deadline, self._divide, self._tensor = work, deadline, divide, tensor

    def wait(self) -> float:
        """Block until the result is in the tensor (and the emulated link delivered it); the seconds waited."""
        t0 = time.perf_counter()
        if self._work is not None:
            self._work.wait()
        Link.hold_until(self._deadline)
        if self._divide > 1:
            self._tensor.div_(self._divide)
        self._work = None
        return time.perf_counter() - t0


class GradientReduce:
    """A stream's mean all-reduced as it is produced (`Channel.gradient_all_reduce`): without a codec, in
    buckets launched during backward (collective.OverlappedAllReduce); under a codec, whole after backward
    (PowerSGD needs every matrix; the residual is per stream), so a compressed stream does not overlap."""

    def __init__(self, channel: Channel, name: str, params: list[Any], grads_flat: torch.Tensor) -> None:
        from distrain.strategies.collective import OverlappedAllReduce

        self.channel, self.name, self.grads_flat = channel, name, grads_flat
        channel.open(name, shapes=[p.shape for p in params])
        self.overlap = None
        if channel.world_size > 1 and channel.codec_of(name) is None:
            weight = channel.weight_of_gradient
            self.overlap = OverlappedAllReduce(params, grads_flat, channel.world_size, link=channel.link, weight=weight)

    def finish(self) -> Traffic:
        """The mean over the workers, in place in the buffer; what it cost."""
        if self.overlap is None:
            weight = self.channel.gradient_weight
            if weight != 1.0:  # (the overlapped buckets are weighted at their launch)
                self.grads_flat.mul_(weight)
            return self.channel.all_reduce(self.name, self.grads_flat)
        seconds = self.overlap.finish()  # the buckets went out during backward: what is left to wait for
        moved = _ring(self.grads_flat.numel() * self.grads_flat.element_size(), self.channel.world_size)
        return Traffic(seconds, moved, moved)

    def remove(self) -> None:
        if self.overlap is not None:
            self.overlap.remove()
            self.overlap = None


def _ring(nbytes: int, world_size: int) -> int:
    from distrain.strategies.collective import ring_allreduce_bytes

    return ring_allreduce_bytes(nbytes, world_size)


def run_codec(config: RunConfig) -> str | None:
    """The name of the codec a run's channels use (as `state_dict` states record it; None: float32), so
    a checkpoint's codec state is compared without reading the flag elsewhere."""
    codec = codec_of(config)
    return None if codec is None else str(codec)


class Channel:
    """A worker's one way to the others and to the shards (see the module docstring)."""

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        self.config = config
        self.ctx = ctx
        self.codec: CodecSpec | None = codec_of(config)
        self.link = Link.of(config)  # one emulated link per worker, shared by all its transfers
        self.group: CollectiveGroup | None = None
        self.streams: dict[str, Stream] = {}
        self._ps: PSClient | None = None
        self._saved: dict[str, Any] = {}  # a checkpoint's stream state, for streams not opened yet
        # Heterogeneous shares (docs/heterogeneous.md): the factor this worker's gradient is multiplied by
        # on its way out (the gradient all-reduce, a gradient push), b_i * N / B, so the others' mean of
        # unequal batches' gradients is the whole batch's. 1 with equal shares. Set per step by the strategy.
        self.gradient_weight = 1.0

    # ------------------------------------------------------------------ the workers' group
    def join(self, rank: int | None = None, size: int | None = None, rendezvous: str | None = None) -> None:
        """Join the workers' process group (default: this worker's rank and size, the run's rendezvous);
        an elastic strategy joins a new one at every re-form (`leave` first)."""
        from distrain.strategies.collective import CollectiveGroup, backend_for

        backend = backend_for(self.ctx.device, self.config.gpus_per_worker)
        self.group = CollectiveGroup(
            self.ctx.rank if rank is None else rank,
            self.ctx.world_size if size is None else size,
            self.ctx.rendezvous if rendezvous is None else rendezvous,
            backend,
            self.config.collective_timeout_s,
            self.link,
        )

    def leave(self, quiet: bool = False) -> None:
        """Leave the group (`quiet`: a broken group may fail to tear down; a new one replaces it)."""
        if self.group is None:
            return
        group, self.group = self.group, None
        try:
            group.destroy()
        except Exception:  # noqa: BLE001 - see `quiet`
            if not quiet:
                raise

    @property
    def joined(self) -> bool:
        return self.group is not None

    @property
    def world_size(self) -> int:
        """The group's size (elastic: the current members'), else the run's workers."""
        return self.group.world_size if self.group is not None else self.ctx.world_size

    def weight_of_gradient(self) -> float:
        """`gradient_weight` as it is now (what the overlapped all-reduce reads at each bucket's launch)."""
        return self.gradient_weight

    # ------------------------------------------------------------------ streams
    def open(self, name: str, shapes: Sequence[Any] | None = None, exact: bool = False, group: Any = None) -> Stream:
        """Declare stream `name`: the shapes of the tensors its flat buffer holds (a codec that compresses
        whole matrices needs them), `exact` for a stream that must travel float32 whatever --compress
        says, and the process `group` its all-reduces run over (made by torch.distributed or a device
        mesh; every worker of it opens the stream alike), under the codec as any stream: a cut replica's
        part of the gradient crosses the R workers holding that part (strategies/sharded_bsp.py). Streams
        used without being opened are flat, compressed, and reduced over every worker."""
        stream = self.streams.get(name)
        if stream is None:
            stream = self.streams[name] = Stream(name, None if shapes is None else list(shapes), exact, group)
        return stream

    def codec_of(self, name: str) -> CodecSpec | None:
        """The codec stream `name` travels under (None: float32)."""
        stream = self.streams.get(name)
        return None if self.codec is None or (stream is not None and stream.exact) else self.codec

    def _reducer(self, stream: Stream, numel: int) -> CompressedAllReduce:
        if stream.reducer is None:
            from distrain.strategies.compressed_collective import CompressedAllReduce

            assert self.codec is not None
            size = self._size_of(stream)
            stream.reducer = CompressedAllReduce(self.codec, size, numel, stream.shapes, self.link, stream.group)
            saved = self._saved.pop(stream.name, None)
            if saved is not None and "reducer" in saved:
                stream.reducer.load_state_dict(saved["reducer"])
        return stream.reducer

    def _size_of(self, stream: Stream) -> int:
        """The ranks stream `stream` is reduced over: its group's, or the channel's."""
        if stream.group is None:
            return self._group().world_size
        import torch.distributed as dist

        return dist.get_world_size(stream.group)

    def _group(self) -> CollectiveGroup:
        assert self.group is not None, "the channel has not joined a group (Channel.join)"
        return self.group

    # ------------------------------------------------------------------ collectives
    def broadcast(self, tensor: torch.Tensor, src: int = 0, subgroup: Any = None) -> None:
        """Everyone (of `subgroup`, if given) takes rank `src`'s tensor, float32, uncharged (set-up:
        replicas start equal)."""
        if subgroup is not None:
            import torch.distributed as dist

            dist.broadcast(tensor, src=src, group=subgroup)
            return
        self._group().broadcast_(tensor, src=src)

    def subgroup(self, ranks: list[int]) -> Any:
        """A process group of some of the workers (every worker must make every subgroup, in one order:
        torch.distributed requires it), e.g. a pipeline stage's replicas; pass it as `subgroup=`."""
        from datetime import timedelta

        import torch.distributed as dist

        self._group()
        return dist.new_group(ranks, timeout=timedelta(seconds=self.config.collective_timeout_s))

    def device_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        """torch's DeviceMesh over every worker of the run (rank order, row-major over `shape`), for the
        parallelism torch runs itself on the run's group (FSDP2: strategies/sharded_bsp.py). Its groups
        have the run's --collective-timeout-s, as the run's group does (`timed_device_mesh`)."""
        from distrain.strategies.collective import timed_device_mesh

        self._group()
        device = "cuda" if self.ctx.device.startswith("cuda") else "cpu"
        return timed_device_mesh(device, shape, names, self.config.collective_timeout_s)

    def all_reduce(
        self, name: str, tensor: torch.Tensor, op: str = "mean", exact_tail: int = 0, subgroup: Any = None
    ) -> Traffic:
        """Replace `tensor` (1-D) in place by its mean (`op="sum"`: sum) over the workers. Under a codec
        the stream's values go through it, except the last `exact_tail` (state that must stay float32,
        e.g. optimizer state and statistics appended to the values), which follow in a second, float32
        all-reduce; without a codec the whole buffer is one transfer. A codec reduces to a mean, so a sum
        (weighted values with their weights, elastic rounds) travels float32. A failed collective raises
        what torch.distributed raised (RuntimeError, OSError), before anything is changed in place.
        Within a `subgroup` (see `subgroup`) the values travel float32; a stream opened over a `group`
        (see `open`) is reduced over that group, under the codec."""
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
        stream = self.open(name)
        self._group()
        if subgroup is not None:
            import torch.distributed as dist

            return self._plain(dist.get_world_size(subgroup), tensor, op, subgroup)
        size = self._size_of(stream)
        head = tensor.numel() - exact_tail
        if self.codec_of(name) is None or head == 0 or op == "sum":
            return self._plain(size, tensor, op, stream.group)
        t0 = time.perf_counter()
        reducer = self._reducer(stream, head)
        sent = reducer.all_reduce_mean_(tensor[:head])
        traffic = Traffic(time.perf_counter() - t0, sent, sent, reducer.last_raw_bytes)
        if exact_tail:
            traffic = traffic + self._plain(size, tensor[head:], "mean", stream.group)
        return traffic

    def _plain(self, size: int, tensor: torch.Tensor, op: str, subgroup: Any = None) -> Traffic:
        """A float32 all-reduce among `size` ranks: one transfer, charged 2(P-1)/P of its bytes."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        moved = _ring(tensor.numel() * tensor.element_size(), size)
        if size > 1:
            done = self.link.reserve(moved, t0)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=subgroup)
            if op == "mean":
                tensor.div_(size)
            self.link.hold_until(done)
        return Traffic(time.perf_counter() - t0, moved, moved)

    def all_reduce_async(self, name: str, tensor: torch.Tensor) -> Pending:
        """Launch the mean all-reduce of `tensor` in the background; the result is in place after
        `wait()`. Float32 streams overlap the caller's compute (the emulated link carries them from now
        on); a compressed stream runs its codec now, blocking, and `wait()` returns at once."""
        import torch.distributed as dist

        stream = self.open(name)
        self._group()
        if self.codec_of(name) is not None:
            t0 = time.perf_counter()
            reducer = self._reducer(stream, tensor.numel())
            sent = reducer.all_reduce_mean_(tensor)
            return Pending(Traffic(time.perf_counter() - t0, sent, sent, reducer.last_raw_bytes))
        size = self._size_of(stream)
        moved = _ring(tensor.numel() * tensor.element_size(), size)
        if size == 1:
            return Pending(Traffic(0.0, moved, moved))
        deadline = self.link.reserve(moved)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True, group=stream.group)
        return Pending(Traffic(0.0, moved, moved), work, deadline, size, tensor)

    def gradient_all_reduce(self, name: str, params: list[Any], grads_flat: torch.Tensor) -> GradientReduce:
        """The mean of a buffer that backward fills (`grads_flat` of `params`), launched as it fills;
        call `finish()` after backward."""
        return GradientReduce(self, name, params, grads_flat)

    def all_gather(self, name: str, tensor: torch.Tensor) -> tuple[list[torch.Tensor], Traffic]:
        """Every worker's `tensor` (same size everywhere), float32: (P-1) x its bytes sent."""
        import torch
        import torch.distributed as dist

        from distrain.strategies.compressed_collective import all_gather_bytes

        group = self._group()
        t0 = time.perf_counter()
        nbytes = all_gather_bytes(tensor.numel() * tensor.element_size(), group.world_size)
        if group.world_size == 1:
            return [tensor.clone()], Traffic(time.perf_counter() - t0)
        out = [torch.empty_like(tensor) for _ in range(group.world_size)]
        done = self.link.reserve(nbytes, t0)
        dist.all_gather(out, tensor.contiguous())
        self.link.hold_until(done)
        return out, Traffic(time.perf_counter() - t0, nbytes, nbytes)

    def reduce_scatter(self, name: str, tensor: torch.Tensor, op: str = "mean") -> tuple[torch.Tensor, Traffic]:
        """This worker's 1/P part of the mean (`op="sum"`: sum) of `tensor` over the workers (its length
        a multiple of P): (P-1)/P of its bytes sent."""
        import torch
        import torch.distributed as dist

        group = self._group()
        p = group.world_size
        if tensor.numel() % p:
            raise ValueError(f"stream {name!r}: {tensor.numel()} values do not split into {p} equal parts")
        t0 = time.perf_counter()
        if p == 1:
            return tensor.clone(), Traffic(time.perf_counter() - t0)
        nbytes = (p - 1) * tensor.numel() * tensor.element_size() // p
        out = torch.empty(tensor.numel() // p, dtype=tensor.dtype, device=tensor.device)
        done = self.link.reserve(nbytes, t0)
        dist.reduce_scatter_tensor(out, tensor.contiguous(), op=dist.ReduceOp.SUM)
        if op == "mean":
            out.div_(p)
        self.link.hold_until(done)
        return out, Traffic(time.perf_counter() - t0, nbytes, nbytes)

    # ------------------------------------------------------------------ parameter-server shards
    @property
    def ps(self) -> PSClient:
        """The client of the run's shards (`ctx.ps_shards`), made on first use."""
        if self._ps is None:
            from distrain.strategies.ps_client import PSClient

            timeout = self.config.hang_timeout_s * PS_WAIT_FACTOR + PS_WAIT_MARGIN_S
            ctx = self.ctx
            self._ps = PSClient(list(ctx.ps_shards), list(ctx.ps_bounds), ctx.rank, timeout, self.link)
        return self._ps

    def pull(self, params: np.ndarray) -> int:
        """Overwrite `params` with the shards' θ (no consistency wait; not charged); this worker's clock."""
        return self.ps.pull(params)

    def push_pull(
        self,
        name: str,
        clock: int,
        grads: torch.Tensor | None,
        lr: float,
        params: np.ndarray,
        client: PSClient | None = None,
    ) -> tuple[PushPullResult, Traffic]:
        """Push `grads` on stream `name` (None: a skipped step, the clock only) to every shard, each slice
        through the codec with its own residual, then install θ in `params`. Counted: the push as sent
        (a skipped step's too, as the float32 gradient it stood for), the pull as received. `client`:
        shards of the worker's own (a cut replica's worker talks to its PS shard alone, over its local
        chunk: strategies/sharded_ps.py); default the run's."""
        bounds = self.ctx.ps_bounds if client is None else client.bounds
        client = client or self.ps
        stream = self.open(name)
        nbytes = params.nbytes
        codec = self.codec_of(name)
        raw = None
        if grads is not None and self.gradient_weight != 1.0:  # a copy: the caller's gradient stays its own
            grads = grads * self.gradient_weight
        payload: Any = None if grads is None else grads.numpy()
        if grads is not None and codec is not None:
            if not stream.shard_feedback:
                self._shard_feedback(stream, codec, bounds)
            payload = [
                (str(codec), ef.encode(grads[start:stop]))
                for ef, (start, stop) in zip(stream.shard_feedback, bounds, strict=True)
            ]
            sent, raw = sum(e.nbytes for _, e in payload), nbytes
        else:
            sent = nbytes
        result = client.push_pull(clock, payload, lr, params)
        return result, Traffic(result.seconds, sent, nbytes, raw)

    def _shard_feedback(self, stream: Stream, codec: CodecSpec, bounds: list[tuple[int, int]]) -> None:
        from distrain.compression.base import ErrorFeedback

        built = codec.build()
        stream.shard_feedback = [ErrorFeedback(built, stop - start) for start, stop in bounds]
        saved = self._saved.pop(stream.name, None)
        if saved is not None and "shards" in saved:
            for ef, residual in zip(stream.shard_feedback, saved["shards"], strict=True):
                ef.residual = residual.detach().float().clone()

    def push_portion_async(
        self, tag: int, portion: int, grads: np.ndarray | None, lr: float, count: int = 1
    ) -> list[Any]:
        """Backup tasks: offer one chunk's gradient (float32; `count` portions from `portion`) to every
        shard; refs to their verdicts."""
        return self.ps.push_portion_async(tag, portion, grads, lr, count)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every stream's codec state on this worker (residuals, PowerSGD's warm start): tensors, ints,
        lists. Empty without a codec."""
        state: dict[str, Any] = {}
        for name, stream in self.streams.items():
            entry: dict[str, Any] = {}
            if stream.reducer is not None:
                entry["reducer"] = stream.reducer.state_dict()
            if stream.shard_feedback:
                entry["shards"] = [ef.residual.clone() for ef in stream.shard_feedback]
            if entry:
                state[name] = entry
        return {**self._saved, **state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back `state_dict()`'s streams: at once for streams already carrying traffic, at first use
        for the others. A stream the state does not name starts at zero (a checkpoint from before)."""
        for name, entry in state.items():
            stream = self.streams.get(name)
            if stream is not None and stream.reducer is not None and "reducer" in entry:
                stream.reducer.load_state_dict(entry["reducer"])
            elif stream is not None and stream.shard_feedback and "shards" in entry:
                for ef, residual in zip(stream.shard_feedback, entry["shards"], strict=True):
                    ef.residual = residual.detach().float().clone()
            else:
                self._saved[name] = entry

    def close(self) -> None:
        self.leave()
