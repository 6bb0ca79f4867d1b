"""`--compress sign` (compression/sign.py) on its own: found by the parser from its file alone, one bit a
value plus one scale on the wire, the scaled sign as decoding, and error feedback's invariant. No Ray."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.compression import CODECS, parse_codec
from distrain.compression.base import ErrorFeedback
from distrain.compression.sign import SignCodec
from distrain.errors import ConfigError
from distrain.strategies.compressed_collective import CompressedAllReduce, wire_parts


def test_the_parser_finds_sign_from_its_file():
    spec = parse_codec("sign")
    assert str(spec) == "sign" and "sign" in CODECS
    assert spec.error_feedback and not spec.needs_shapes and spec.reduction == "gather"
    assert isinstance(spec.build(), SignCodec)
    with pytest.raises(ConfigError, match="sign takes no argument"):
        parse_codec("sign:2")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 10_001])
def test_one_bit_a_value_and_the_scaled_sign_back(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[0] = 0.0  # a zero decodes as +scale
    codec = parse_codec("sign").build()
    enc = codec.encode(x)
    assert enc.parts["bits"].dtype == torch.uint8 and enc.nbytes == math.ceil(n / 8) + 4
    out = codec.decode(enc)
    scale = x.abs().mean()
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.allclose(out.abs(), scale.expand(n))
    assert torch.equal(out < 0, x < 0)


def test_error_feedback_keeps_what_was_not_sent():
    """Sum of everything decoded plus the last residual is the sum of everything that was to be sent."""
    feedback = ErrorFeedback(parse_codec("sign").build(), 500)
    g = torch.Generator().manual_seed(1)
    sent_in, decoded = torch.zeros(500), torch.zeros(500)
    for _ in range(20):
        x = torch.randn(500, generator=g)
        sent_in += x
        decoded += feedback.codec.decode(feedback.encode(x))
    assert torch.allclose(decoded + feedback.residual, sent_in, atol=1e-4)
    assert feedback.residual.abs().max() > 0  # a lossy code: something was carried over


def test_a_single_rank_all_reduce_is_the_codec_and_counts_no_bytes():
    """Through the channel's compressed all-reduce (one rank: nothing sent), and the planner's parts."""
    x = torch.randn(100, generator=torch.Generator().manual_seed(2))
    reducer = CompressedAllReduce(parse_codec("sign"), 1, 100)
    buffer = x.clone()
    assert reducer.all_reduce_mean_(buffer) == 0
    assert torch.allclose(buffer.abs(), x.abs().mean().expand(100)) and torch.equal(buffer < 0, x < 0)
    assert torch.allclose(reducer.residual, x - buffer)
    assert wire_parts(parse_codec("sign"), [(10, 10)]) == [("gather", 13 + 4)]
