"""sign: scaled sign compression with error feedback (EF-signSGD, Karimireddy et al. 2019).

Each value travels as its sign, one bit, packed eight to a byte; one float32 scale per stream, the
mean absolute value: C(x) = mean(|x|) · sign(x). About 32x fewer bytes than fp32. Biased (the
magnitudes are lost), so the sender keeps the residual e <- (x + e) - C(x + e) (`ErrorFeedback`),
which is what makes signSGD with error feedback converge like SGD. A zero decodes as +scale: its
residual carries the difference to the next step.
"""

from __future__ import annotations

import torch

from distrain.compression.base import Codec, Encoded

# Found by compression/spec.py (read, not imported): `--compress sign`.
CODECS = [{"name": "sign", "class": "SignCodec", "error_feedback": True, "order": 60}]

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a byte: value 8k + i


class SignCodec(Codec):
    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.detach().to(torch.float32)
        n = x.numel()
        scale = x.abs().mean().reshape(1) if n else torch.zeros(1)
        negative = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
        negative[:n] = (x < 0).to(torch.uint8)
        bits = (negative.view(-1, 8) * _BITS).sum(dim=1, dtype=torch.uint8)  # distinct bits: the sum is an OR
        return Encoded({"bits": bits, "scale": scale}, n)

    def decode(self, enc: Encoded) -> torch.Tensor:
        bits, scale = enc.parts["bits"], enc.parts["scale"]
        negative = (bits[:, None] & _BITS).ne(0).view(-1)[: enc.numel]
        return torch.where(negative, -scale, scale).to(torch.float32)
