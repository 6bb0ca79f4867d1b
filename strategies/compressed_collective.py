"""A compressed all-reduce: one stream of traffic (a worker's gradients, or its pseudo-gradients) under
one codec (`--compress`, see distrain/compression). The channel's (strategies/channel.py) engine for
compressed streams between workers; strategies reach it only through the channel.

Which collective each codec uses (its declared `reduction`, compression/spec.py), and the bytes it
counts (what this worker puts on the wire, per transfer, times the collective's factor; the emulated
link is charged with exactly that):
- "sum", fp16 / bf16: all-reduce in that dtype (the sum is taken in 16 bits), then the mean in fp32; no error
  feedback. Bytes: 2(P-1)/P x payload (a ring all-reduce).
- "gather", the default (int8, top-k): quantised values cannot be summed as they are, so every rank
  all-gathers every rank's encoded parts (packed into one byte buffer: one transfer) and averages the
  decoded values. Error
  feedback per stream on this worker: e <- (x + e) - D(C(x + e)). Bytes: (P-1) x payload.
- "rounds", PowerSGD: three all-reduces (the uncompressed vectors in fp32, then P, then Q), each 2(P-1)/P of its
  payload; error feedback as the hook's: e <- (x + e) - (the decoded mean). It needs the tensors' shapes.
It reduces over the default group, or over the `group` it is given (a cut replica's part crosses the
R replicas only: strategies/sharded_bsp.py). With one rank the codec still runs (decode(encode(x + e)),
the residual kept), nothing is sent, and the bytes are 0: a single worker computes what the compressed
multi-worker run would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from distrain.compression.base import Encoded, ErrorFeedback
from distrain.compression.spec import FLAG, CodecSpec
from distrain.errors import ConfigError
from distrain.strategies.collective import ring_allreduce_bytes
from distrain.strategies.network import Link


class CompressedAllReduce:
    """One stream of traffic under one codec; residuals and PowerSGD's Q warm start persist across calls."""

    def __init__(
        self,
        spec: CodecSpec,
        world_size: int,
        numel: int,
        shapes: Sequence[torch.Size] | None = None,
        link: Link | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if spec.needs_shapes and shapes is None:
            raise ConfigError(
                f"{FLAG} {spec} needs whole matrices: this transport holds flat slices of the parameters "
                "(the parameter server's shards); use an all-reduce strategy, or another codec"
            )
        if shapes is not None:
            total = sum(int(torch.Size(s).numel()) for s in shapes)
            if total != numel:
                raise ValueError(f"the shapes hold {total} values, the buffer {numel}")
        self.spec = spec
        self.world_size = world_size
        self.numel = numel
        self.link = link or Link()
        self.group = group  # the ranks it reduces over (None: the default group; `world_size` is its size)
        self.codec = spec.build(shapes) if spec.needs_shapes else spec.build()
        self.feedback = ErrorFeedback(self.codec, numel)
        self.last_raw_bytes = 0  # an uncompressed fp32 ring all-reduce of the same buffer, last call
        self.last_bytes = 0  # what the last call put on the wire (its return value)
        self.sent = 0  # bytes counted so far in the call under way

    @property
    def residual(self) -> torch.Tensor:
        return self.feedback.residual

    def all_reduce_mean_(self, buffer: torch.Tensor) -> int:
        """Replace `buffer` (1-D float32, length numel) in place by the mean over the ranks of each rank's
        decoded (compressed) buffer; returns the bytes this worker put on the wire for it (collective
        factor included). The emulated link is charged with exactly those bytes, transfer by transfer."""
        if buffer.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got {buffer.numel()}")
        self.last_raw_bytes = ring_allreduce_bytes(self.numel * 4, self.world_size)
        self.sent = 0
        reduction = self.spec.reduction
        if reduction == "rounds":
            corrected = buffer.detach().to(torch.float32) + self.feedback.residual
            if self.world_size > 1:
                enc = self.codec.encode(corrected, all_reduce=self._ring_sum_, world_size=self.world_size)
            else:
                enc = self.codec.encode(corrected)
            out = self.codec.decode(enc)
            self.feedback.residual = corrected.sub_(out)
        elif reduction == "sum":
            enc = self.codec.encode(buffer)
            if self.world_size > 1:
                self._ring_sum_(enc.parts["values"])
            out = self.codec.decode(enc)
            if self.world_size > 1:
                out.div_(self.world_size)
        else:  # "gather": all-gather the encoded parts, decode each rank's, average
            enc = self.feedback.encode(buffer)
            if self.world_size > 1:
                out = torch.zeros(self.numel, dtype=torch.float32)
                for other in self._all_gather(enc):
                    out += self.codec.decode(other)
                out.div_(self.world_size)
            else:
                out = self.codec.decode(enc)
        with torch.no_grad():
            buffer.copy_(out)
        self.last_bytes = self.sent
        return self.sent

    def _ring_sum_(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` across the ranks in place: one transfer, charged 2(P-1)/P of its bytes."""
        if tensor.numel() == 0:
            return
        nbytes = ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size)
        done = self.link.reserve(nbytes, time.perf_counter())
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self.link.hold_until(done)
        self.sent += nbytes

    def _all_gather(self, enc: Encoded) -> list[Encoded]:
        """Every rank's `Encoded` (same part sizes on all ranks): one transfer of the packed parts,
        charged (P-1) x payload."""
        names = sorted(enc.parts)
        parts = [enc.parts[n].contiguous() for n in names]
        packed = torch.cat([p.view(-1).view(torch.uint8) for p in parts])
        nbytes = all_gather_bytes(packed.numel(), self.world_size)
        gathered = [torch.empty_like(packed) for _ in range(self.world_size)]
        done = self.link.reserve(nbytes, time.perf_counter())
        dist.all_gather(gathered, packed, group=self.group)
        self.link.hold_until(done)
        self.sent += nbytes
        out = []
        for flat in gathered:
            at, unpacked = 0, {}
            for n, p in zip(names, parts, strict=True):
                size = p.numel() * p.element_size()
                unpacked[n] = flat[at : at + size].clone().view(p.dtype).view(p.shape)  # clone: aligned
                at += size
            out.append(Encoded(unpacked, enc.numel))
        return out

    def state_dict(self) -> dict:
        """The residual and PowerSGD's warm start, for checkpoints (tensors, ints and lists only)."""
        state: dict = {"codec": str(self.spec), "residual": self.feedback.residual.clone()}
        if hasattr(self.codec, "state_dict"):  # a stateful codec (PowerSGD's warm start)
            state["powersgd"] = self.codec.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("codec") != str(self.spec):
            raise ConfigError(
                f"{FLAG} {self.spec}: the checkpoint's compression state is for {state.get('codec')!r}"
            )
        residual = state["residual"]
        if residual.numel() != self.numel:
            raise ValueError(f"the checkpoint's residual holds {residual.numel()} values, the buffer {self.numel}")
        self.feedback.residual = residual.detach().to(torch.float32).clone()
        if "powersgd" in state:
            self.codec.load_state_dict(state["powersgd"])


def all_gather_bytes(payload: int, world_size: int) -> int:
    """What one rank sends in an all-gather of a `payload`-byte buffer: (P-1) x payload."""
    return (world_size - 1) * payload


def wire_parts(spec: CodecSpec, shapes: Sequence[tuple[int, ...]]) -> list[tuple[str, int]]:
    """The transfers one `all_reduce_mean_` of a buffer of tensors of `shapes` makes, as (collective,
    payload bytes): "ring" (charged ring_allreduce_bytes) or "gather" (charged all_gather_bytes). Read
    from a real encoding (random values) by the codec itself, so the planner counts the bytes this module
    puts on the wire: sum the charges over the parts for a world of P ranks."""
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    codec = spec.build([torch.Size(s) for s in shapes]) if spec.needs_shapes else spec.build()
    enc = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    if spec.reduction == "rounds":  # one all-reduce per part (PowerSGD: vectors, P, Q), each skipped when empty
        return [("ring", _nbytes(t)) for t in enc.parts.values() if t.numel()]
    if spec.reduction == "sum":  # one all-reduce of the encoded values (16 bits)
        return [("ring", _nbytes(enc.parts["values"]))]
    return [("gather", enc.nbytes)]  # the packed parts, all-gathered


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
