"""The run's `--compress` codec over one stream of collective traffic (see compression/ and
compressed_collective.py): a strategy asks for one stream per kind of tensor it reduces, since each
stream keeps its own error-feedback residual and PowerSGD warm start."""

from __future__ import annotations

from typing import TYPE_CHECKING

from distrain.compression import parse_codec

if TYPE_CHECKING:
    import torch

    from distrain.config import RunConfig
    from distrain.strategies.compressed_collective import CompressedAllReduce
    from distrain.strategies.network import Link


def compressed_stream(
    config: RunConfig, world_size: int, shapes: list[torch.Size], link: Link
) -> CompressedAllReduce | None:
    """A compressed all-reduce of a flat buffer made of tensors of `shapes`; None without --compress."""
    codec = parse_codec(config.compress) if config.compress else None
    if codec is None:
        return None
    from distrain.strategies.compressed_collective import CompressedAllReduce

    numel = sum(s.numel() for s in shapes)
    return CompressedAllReduce(codec, world_size, numel, shapes=list(shapes), link=link)
