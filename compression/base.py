"""The codec interface, what goes on the wire, and error feedback.

A codec turns a 1-D float32 tensor x into an `Encoded` (a few tensors, fewer bytes) and back. Error
feedback (Seide 2014, Karimireddy 2019) keeps the sender's residual e: send C(x + e), then
e <- (x + e) - D(C(x + e)); so the sum of everything decoded plus the last residual is the sum of
everything that was to be sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from distrain.compression.spec import CodecSpec


@dataclass
class Encoded:
    """What goes on the wire; picklable (Ray ships it to parameter-server shards)."""

    parts: dict[str, torch.Tensor]
    numel: int  # length of the decoded flat tensor

    @property
    def nbytes(self) -> int:
        """The payload on the wire: the sum of the parts' bytes."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class Codec:
    """Stateless, except PowerSGD's warm start (its Q matrices from the last call)."""

    spec: CodecSpec

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def encode(self, x: torch.Tensor) -> Encoded:
        """x: 1-D float32."""
        raise NotImplementedError

    def decode(self, enc: Encoded) -> torch.Tensor:
        """A new 1-D float32 tensor of length enc.numel."""
        raise NotImplementedError


class ErrorFeedback:
    """The sender's residual for one stream of traffic: send C(x + e); e <- (x + e) - D(C(x + e)).

    Codecs without error feedback (`spec.error_feedback` False: the casts) encode x as it is and the
    residual stays zero.
    """

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def encode(self, x: torch.Tensor) -> Encoded:
        if not self.codec.spec.error_feedback:
            return self.codec.encode(x)
        corrected = x.detach().to(torch.float32) + self.residual
        enc = self.codec.encode(corrected)
        self.residual = corrected.sub_(self.codec.decode(enc))
        return enc
