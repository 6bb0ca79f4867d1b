"""PowerSGD rank r (Vogels et al. 2019), step for step as PyTorch's DDP hook
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook` (warm start on).

The flat buffer is cut by `shapes` into tensors. A tensor of two or more dimensions is a matrix M
(viewed as shape[0] x the rest), given rank r' = min(r, rows, cols), and compressed when that saves
bytes, as the hook decides with `min_compression_rate` (here 1 by default): r'(rows + cols) * rate <
rows * cols. Then
    P = M·Q; all-reduce P; orthonormalise P; Q = Mᵀ·P; all-reduce Q; M̂ = P·Qᵀ / world.
One-dimensional tensors (biases, norms' scales) and the matrices not worth compressing (any matrix at
r' = min(rows, cols)) are concatenated and all-reduced uncompressed (fp32), in the order they come.
Q warm-starts from the last call; the first call draws it as the hook does: a NumPy RandomState(seed)
gives a torch seed, and the Qs are drawn N(0, 1) in the hook's order (matrices grouped by shape, in the
order each shape first appears), each then orthonormalised. Orthonormalisation is the hook's too:
Gram-Schmidt for r' <= 2, QR above.

Where it departs from the hook: one-dimensional tensors are never compressed (with a rate below
n / (n + 1) the hook would compress an n-vector as an n x 1 matrix; at the default rate 1 it does not
either); and where the hook would produce NaN (a
column of zeros in Gram-Schmidt, with its default epsilon 0) the column stays zero, and a warm-start Q
with a zero column is drawn again, so a matrix whose gradient was zero for one step is not stuck at
zero afterwards.

As a `Codec` on its own (one worker), `encode` runs the same steps with no peers: the `Encoded` holds the
orthonormal P, Q and the vectors, and `decode` is P·Qᵀ. `CompressedAllReduce` passes the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from distrain.compression.base import Codec, Encoded
from distrain.compression.spec import FLAG
from distrain.errors import ConfigError

if TYPE_CHECKING:
    from distrain.compression.spec import CodecSpec

# Found by compression/spec.py (read, not imported): its encode runs the all-reduces (P, then Q) itself.
CODECS = [
    {
        "name": "powersgd",
        "class": "PowerSGDCodec",
        "argument": "rank",
        "error_feedback": True,
        "needs_shapes": True,
        "reduction": "rounds",
        "order": 50,
    }
]

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across the ranks, in place


def orthogonalize_(matrices: torch.Tensor) -> None:
    """Orthonormalise the columns of each matrix in a (batch, rows, r) tensor in place, as the hook's
    `_orthogonalize` (epsilon 0): Gram-Schmidt for r <= 2, QR above. A zero column stays zero."""
    rank = matrices.shape[2]
    if rank > 2:
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)
        return
    for i in range(rank):
        col = matrices[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < rank:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


class PowerSGDCodec(Codec):
    def __init__(
        self,
        spec: CodecSpec,
        shapes: Sequence[Sequence[int]] | None = None,
        seed: int = 0,
        min_compression_rate: float = 1.0,
    ) -> None:
        super().__init__(spec)
        self.seed = seed
        self.min_compression_rate = min_compression_rate
        self.rng = np.random.RandomState(seed)
        self.qs: list[torch.Tensor] | None = None  # warm start: one (1, cols, r') per matrix, in `order`
        self.shapes = None if shapes is None else [tuple(int(d) for d in s) for s in shapes]
        if self.shapes is not None:
            self._lay_out(self.shapes)

    def _lay_out(self, shapes: list[tuple[int, ...]]) -> None:
        self.vectors: list[tuple[int, int]] = []  # (offset, numel)
        found: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}  # by shape: (offset, rows, cols, r')
        offset = 0
        for shape in shapes:
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            rows = shape[0] if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            r = min(self.spec.rank, rows, cols)
            if rows and cols and r * (rows + cols) * self.min_compression_rate < rows * cols:  # the hook's test
                found.setdefault((rows, cols), []).append((offset, rows, cols, r))
            else:
                self.vectors.append((offset, numel))
            offset += numel
        self.numel = offset
        # The hook batches the matrices by shape, in the order each shape first appears: Ps, Qs and the
        # random initial Qs follow that order.
        self.matrices = [m for group in found.values() for m in group]

    def _require_shapes(self) -> None:
        if self.shapes is None:
            raise ConfigError(
                f"{FLAG} {self.spec} needs whole matrices: the tensors' shapes are not known here "
                "(a parameter-server shard holds a flat slice); use it with an all-reduce strategy"
            )

    def _initial_qs(self) -> list[torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rng.randint(1_000_000_000))
            qs = []
            for _, _, cols, r in self.matrices:
                q = torch.randn(1, cols, r, dtype=torch.float32)
                orthogonalize_(q)
                qs.append(q)
        return qs

    def encode(self, x: torch.Tensor, all_reduce: AllReduce | None = None, world_size: int = 1) -> Encoded:
        """One PowerSGD round on x (1-D float32, the shapes' total length). With `all_reduce` (summing
        across `world_size` ranks), P, Q and the vectors are the ranks' common values, and decoding gives
        the approximate mean; without, one rank's own compression."""
        self._require_shapes()
        if x.numel() != self.numel:
            raise ValueError(f"PowerSGD: got {x.numel()} values for shapes totalling {self.numel}")
        x = x.detach()
        reduce = all_reduce or (lambda t: None)
        vectors = torch.cat([x[o : o + n] for o, n in self.vectors]) if self.vectors else torch.zeros(0)
        reduce(vectors)
        vectors.div_(world_size)
        if self.qs is None:
            qs = self._initial_qs()
        else:
            qs = self.qs
            for i, q in enumerate(qs):
                if bool((torch.linalg.vector_norm(q, dim=1) == 0).any()):  # equal on all ranks: Q was reduced
                    qs[i] = self._redraw(q.shape)
                orthogonalize_(qs[i])
        ms = [x[o : o + rows * cols].view(1, rows, cols) for o, rows, cols, _ in self.matrices]
        p_all = torch.cat([torch.bmm(m, q).view(-1) for m, q in zip(ms, qs, strict=True)] or [torch.zeros(0)])
        reduce(p_all)
        ps = self._split(p_all, [(rows, r) for _, rows, _, r in self.matrices])
        for p in ps:
            orthogonalize_(p)
        q_all = torch.cat(
            [torch.bmm(m.transpose(1, 2), p).view(-1) for m, p in zip(ms, ps, strict=True)] or [torch.zeros(0)]
        )
        reduce(q_all)
        q_all.div_(world_size)
        self.qs = [q.clone() for q in self._split(q_all, [(cols, r) for _, _, cols, r in self.matrices])]
        # In the order they were all-reduced (compressed_collective.wire_parts counts them so).
        return Encoded({"vectors": vectors, "p": p_all, "q": q_all}, self.numel)

    def _redraw(self, shape: torch.Size) -> torch.Tensor:
        generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        return torch.randn(*shape, generator=generator, dtype=torch.float32)

    @staticmethod
    def _split(flat: torch.Tensor, dims: list[tuple[int, int]]) -> list[torch.Tensor]:
        out, at = [], 0
        for a, b in dims:
            out.append(flat[at : at + a * b].view(1, a, b))
            at += a * b
        return out

    def decode(self, enc: Encoded) -> torch.Tensor:
        self._require_shapes()
        out = torch.empty(self.numel, dtype=torch.float32)
        at = 0
        for o, n in self.vectors:
            out[o : o + n] = enc.parts["vectors"][at : at + n]
            at += n
        ps = self._split(enc.parts["p"], [(rows, r) for _, rows, _, r in self.matrices])
        qs = self._split(enc.parts["q"], [(cols, r) for _, _, cols, r in self.matrices])
        for (o, rows, cols, _), p, q in zip(self.matrices, ps, qs, strict=True):
            out[o : o + rows * cols] = torch.bmm(p, q.transpose(1, 2)).view(-1)
        return out

    def state_dict(self) -> dict:
        """The warm start (Qs) and the seed generator's state: plain tensors, ints and lists."""
        name, keys, pos, has_gauss, cached = self.rng.get_state()
        return {
            "qs": None if self.qs is None else [q.clone() for q in self.qs],
            "rng": {
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.qs = None if state["qs"] is None else [q.clone() for q in state["qs"]]
        rng = state["rng"]
        self.rng.set_state(
            ("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["cached_gaussian"])
        )
