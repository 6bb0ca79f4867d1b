"""int8: per-chunk scale s = max|x| / 127 over chunks of 1024 entries, q = round(x / s).

On the wire: q (int8, one byte an entry) and the scales (fp32, one per chunk): about 4x fewer bytes
than fp32. Decoding gives q * s, within s / 2 of x entry by entry. A chunk of zeros has s = 0 and
decodes to zeros (nothing is divided by zero).
"""

from __future__ import annotations

import torch

from distrain.compression.base import Codec, Encoded

CODECS = [{"name": "int8", "class": "Int8Codec", "error_feedback": True, "order": 30}]  # see compression/spec.py

CHUNK = 1024


class Int8Codec(Codec):
    def encode(self, x: torch.Tensor) -> Encoded:
        n = x.numel()
        chunks = -(-n // CHUNK)
        padded = torch.zeros(chunks * CHUNK, dtype=torch.float32)
        padded[:n] = x.detach()
        blocks = padded.view(chunks, CHUNK)
        scales = blocks.abs().amax(dim=1) / 127
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(blocks / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
        return Encoded({"q": q.view(-1)[:n].clone(), "scales": scales}, n)

    def decode(self, enc: Encoded) -> torch.Tensor:
        q, scales = enc.parts["q"], enc.parts["scales"]
        out = torch.zeros(scales.numel() * CHUNK, dtype=torch.float32)
        out[: enc.numel] = q.to(torch.float32)
        out = out.view(-1, CHUNK).mul_(scales[:, None]).view(-1)
        return out[: enc.numel].clone()
