"""fp16 / bf16: cast to 16 bits on the wire (2x fewer bytes than fp32); no error feedback."""

from __future__ import annotations

import torch

from distrain.compression.base import Codec, Encoded

# Found by compression/spec.py (read, not imported). Summed in 16 bits as encoded; no residual.
CODECS = [
    {"name": "fp16", "class": "CastCodec", "reduction": "sum", "order": 10},
    {"name": "bf16", "class": "CastCodec", "reduction": "sum", "order": 20},
]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastCodec(Codec):
    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.spec.name]

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded({"values": x.detach().to(self.dtype)}, x.numel())

    def decode(self, enc: Encoded) -> torch.Tensor:
        return enc.parts["values"].to(torch.float32)
