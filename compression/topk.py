"""top-k: send the k = max(1, ceil(fraction * n)) largest-magnitude entries, values (fp32) and
indices (int32); the rest decodes to zero. n / (2k) fewer bytes than fp32; needs error feedback.
"""

from __future__ import annotations

import math

import torch

from distrain.compression.base import Codec, Encoded

CODECS = [  # see compression/spec.py
    {"name": "topk", "class": "TopKCodec", "argument": "fraction", "error_feedback": True, "order": 40}
]


def topk_count(fraction: float, n: int) -> int:
    return min(n, max(1, math.ceil(fraction * n)))


class TopKCodec(Codec):
    def k(self, n: int) -> int:
        return topk_count(self.spec.fraction, n)

    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.detach()
        n = x.numel()
        indices = torch.topk(x.abs(), self.k(n), sorted=False).indices
        return Encoded({"values": x[indices].to(torch.float32), "indices": indices.to(torch.int32)}, n)

    def decode(self, enc: Encoded) -> torch.Tensor:
        out = torch.zeros(enc.numel, dtype=torch.float32)
        out[enc.parts["indices"].long()] = enc.parts["values"]
        return out
