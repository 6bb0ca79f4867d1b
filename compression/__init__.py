"""Gradient compression on the wire: codecs (fp16, bf16, int8, top-k, PowerSGD) and error feedback.

Torch-free at import: `CodecSpec` and `parse_codec` validate `--compress` before torch loads. The
codecs themselves (`base.py`, `cast.py`, `int8.py`, `topk.py`, `powersgd.py`) import torch and load
only through `CodecSpec.build()`. The compressed all-reduce that puts them on the wire is
`distrain.strategies.compressed_collective.CompressedAllReduce`.
"""

from distrain.compression.spec import CODECS, CodecSpec, parse_codec

__all__ = ["CODECS", "CodecSpec", "parse_codec"]
