"""The codecs of `--compress` on their own (no Ray, no process group): error bounds, bytes on the wire,
error feedback's invariant, PowerSGD at full rank, and the flag's parser."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from distrain.compression import CODECS, CodecSpec, parse_codec
from distrain.compression.base import Encoded, ErrorFeedback
from distrain.compression.int8 import CHUNK
from distrain.compression.powersgd import PowerSGDCodec
from distrain.errors import ConfigError
from distrain.strategies.compressed_collective import CompressedAllReduce

N = 10_000  # not a multiple of int8's chunk: the last chunk is partial


def vector(seed: int, n: int = N) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]


def roundtrip(text: str, x: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
    codec = parse_codec(text).build()
    enc = codec.encode(x)
    out = codec.decode(enc)
    assert out.dtype == torch.float32 and out.shape == x.shape
    return enc, out


@pytest.mark.parametrize(("text", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_within_their_dtypes_relative_bound(text, dtype):
    x = vector(0) / 100  # within fp16's normal range (no overflow, few subnormals)
    x = x[x.abs() > 1e-4]
    enc, out = roundtrip(text, x)
    eps = torch.finfo(dtype).eps  # round to nearest: relative error <= eps / 2
    assert torch.all((out - x).abs() <= x.abs() * eps / 2)
    assert enc.nbytes * 2 == x.numel() * 4  # 2x fewer bytes than fp32
    assert not parse_codec(text).error_feedback


def test_int8_within_half_a_scale_per_entry():
    x = vector(1)
    x[2048:3072] = 0  # a chunk of zeros: scale 0, nothing divided by zero
    enc, out = roundtrip("int8", x)
    scales = enc.parts["scales"]
    assert enc.parts["q"].dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.numel() == math.ceil(N / CHUNK) and scales[2] == 0
    per_entry = scales.repeat_interleave(CHUNK)[:N]
    assert torch.all((out - x).abs() <= per_entry / 2 * (1 + 1e-5))
    assert torch.all(out[2048:3072] == 0) and torch.isfinite(out).all()
    assert enc.nbytes == N + 4 * math.ceil(N / CHUNK)  # one byte an entry, plus the scales
    assert 3.9 < N * 4 / enc.nbytes < 4


def test_topk_keeps_the_k_largest_exactly_and_zeroes_the_rest():
    x = vector(2)
    enc, out = roundtrip("topk:0.01", x)
    k = math.ceil(0.01 * N)
    kept = out != 0
    assert kept.sum() == k == enc.parts["values"].numel()
    assert torch.equal(out[kept], x[kept])  # exact on the kept entries
    assert x[kept].abs().min() >= x[~kept].abs().max()  # the k largest magnitudes
    assert enc.parts["values"].dtype == torch.float32 and enc.parts["indices"].dtype == torch.int32
    assert enc.nbytes == 8 * k and N * 4 / enc.nbytes == N / (2 * k)


def test_topk_keeps_at_least_one_entry():
    enc, out = roundtrip("topk:0.0001", torch.tensor([0.5, -3.0, 1.0]))
    assert out.tolist() == [0.0, -3.0, 0.0] and enc.parts["values"].numel() == 1


def test_encoded_pickles():
    import pickle

    enc, _ = roundtrip("int8", vector(3, 100))
    back = pickle.loads(pickle.dumps(enc))
    assert back.numel == 100 and torch.equal(back.parts["q"], enc.parts["q"]) and back.nbytes == enc.nbytes


@pytest.mark.parametrize("text", ["int8", "topk:0.05"])
def test_error_feedback_loses_nothing(text):
    """Sum of everything decoded + the final residual = sum of everything that was to be sent."""
    spec = parse_codec(text)
    assert spec.error_feedback
    codec = spec.build()
    feedback = ErrorFeedback(codec, 2000)
    sent, decoded = torch.zeros(2000, dtype=torch.float64), torch.zeros(2000, dtype=torch.float64)
    for step in range(60):
        x = vector(100 + step, 2000)
        sent += x.double()
        decoded += codec.decode(feedback.encode(x)).double()
    assert feedback.residual.abs().max() > 0  # it did hold something back
    assert torch.allclose(decoded + feedback.residual.double(), sent, atol=1e-4)


def test_casts_keep_no_residual():
    codec = parse_codec("fp16").build()
    feedback = ErrorFeedback(codec, 100)
    out = codec.decode(feedback.encode(vector(4, 100)))
    assert torch.equal(feedback.residual, torch.zeros(100)) and out.dtype == torch.float32


SHAPES = [torch.Size([16, 20]), torch.Size([16]), torch.Size([4, 16]), torch.Size([4]), torch.Size([3, 2, 5])]
NUMEL = sum(s.numel() for s in SHAPES)


@pytest.mark.parametrize("text", ["fp16", "bf16", "int8", "topk:0.1", "powersgd:2"])
def test_one_worker_applies_the_codec_sends_nothing(text):
    """P = 1: the buffer becomes decode(encode(x + e)) as in a compressed multi-worker run; 0 bytes."""
    spec = parse_codec(text)
    reducer = CompressedAllReduce(spec, 1, NUMEL, shapes=SHAPES if spec.needs_shapes else None)
    x = vector(5, NUMEL)
    buffer = x.clone()
    assert reducer.all_reduce_mean_(buffer) == 0 and reducer.last_raw_bytes == 0
    assert not torch.equal(buffer, x)  # the codec did act
    assert torch.allclose(buffer + reducer.residual, x, atol=1e-6) or not spec.error_feedback
    if not spec.error_feedback:
        assert torch.allclose(buffer, x, rtol=1e-2, atol=1e-3)


def test_powersgd_error_feedback_loses_nothing():
    reducer = CompressedAllReduce(CodecSpec("powersgd", rank=1), 1, NUMEL, shapes=SHAPES)
    sent, decoded = torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL, dtype=torch.float64)
    for step in range(60):
        buffer = vector(200 + step, NUMEL)
        sent += buffer.double()
        reducer.all_reduce_mean_(buffer)
        decoded += buffer.double()
    assert reducer.residual.abs().max() > 1e-3
    assert torch.allclose(decoded + reducer.residual.double(), sent, atol=1e-4)


def test_powersgd_rank_clamps_to_the_smaller_side_and_is_then_exact():
    """Compressed at any cost (min_compression_rate 0), the rank is min(50, rows, cols) and P·Qᵀ is exact."""
    spec = CodecSpec("powersgd", rank=50)
    codec = PowerSGDCodec(spec, SHAPES, min_compression_rate=0)
    assert [r for *_, r in codec.matrices] == [16, 4, 3]  # 16x20, 4x16, 3x10 (3x2x5 viewed as 3 x 10)
    for step in range(3):  # the first draw and two warm starts
        x = vector(300 + step, NUMEL)
        enc = codec.encode(x)
        assert torch.allclose(codec.decode(enc), x, rtol=1e-4, atol=1e-4)
        assert enc.parts["p"].numel() == 16 * 16 + 4 * 4 + 3 * 3 and enc.parts["q"].numel() == 20 * 16 + 16 * 4 + 10 * 3
        assert enc.parts["vectors"].numel() == 20  # the two biases travel uncompressed


def test_powersgd_sends_matrices_uncompressed_where_p_and_q_would_not_save_bytes():
    """By default (as the hook with min_compression_rate=1) a matrix goes as P and Q only when
    r'(m + n) < m·n: at full rank everything travels as fp32, exactly."""
    full = CodecSpec("powersgd", rank=50).build(SHAPES)
    assert full.matrices == [] and sum(n for _, n in full.vectors) == NUMEL
    x = vector(11, NUMEL)
    enc = full.encode(x)
    assert torch.equal(full.decode(enc), x) and enc.nbytes == 4 * NUMEL
    codec = CodecSpec("powersgd", rank=3).build(SHAPES)  # 3·(4+16) = 60 < 64, but 3·(3+10) = 39 >= 30
    assert [(rows, cols, r) for _, rows, cols, r in codec.matrices] == [(16, 20, 3), (4, 16, 3)]
    assert enc.nbytes > codec.encode(x).nbytes


def test_powersgd_low_rank_bytes_and_warm_start():
    codec = CodecSpec("powersgd", rank=2).build(SHAPES)
    x = vector(7, NUMEL)
    first = codec.encode(x)
    assert first.nbytes == 4 * (2 * (16 + 20) + 2 * (4 + 16) + 2 * (3 + 10) + 20)  # r(m + n) per matrix + vectors
    errors = []
    for _ in range(4):  # the same matrix again: the power iteration from the warm-started Q improves the fit
        errors.append((codec.decode(codec.encode(x)) - x).norm().item())
    assert errors[-1] < errors[0]
    state = codec.state_dict()
    again = CodecSpec("powersgd", rank=2).build(SHAPES)
    again.load_state_dict(state)
    assert torch.equal(again.decode(again.encode(x)), codec.decode(codec.encode(x)))


def test_powersgd_zero_gradient_gives_zeros_and_recovers():
    """Where the hook (epsilon 0) would divide by zero, the matrix decodes to zeros; the next step works."""
    codec = CodecSpec("powersgd", rank=2).build(SHAPES)
    zero = codec.decode(codec.encode(torch.zeros(NUMEL)))
    assert torch.equal(zero, torch.zeros(NUMEL))
    x = vector(8, NUMEL)
    out = codec.decode(codec.encode(x))
    assert torch.isfinite(out).all() and (out - x).norm() < x.norm()
    assert all(torch.linalg.vector_norm(q, dim=1).min() > 0 for q in codec.qs)


def test_collective_state_round_trips():
    spec = CodecSpec("powersgd", rank=1)
    reducer = CompressedAllReduce(spec, 1, NUMEL, shapes=SHAPES)
    reducer.all_reduce_mean_(vector(9, NUMEL))
    state = reducer.state_dict()
    restored = CompressedAllReduce(spec, 1, NUMEL, shapes=SHAPES)
    restored.load_state_dict(state)
    a, b = vector(10, NUMEL), vector(10, NUMEL)
    reducer.all_reduce_mean_(a)
    restored.all_reduce_mean_(b)
    assert torch.equal(a, b) and torch.equal(reducer.residual, restored.residual)
    with pytest.raises(ConfigError, match="--compress int8"):
        CompressedAllReduce(parse_codec("int8"), 1, NUMEL).load_state_dict(state)


def test_powersgd_without_shapes_is_refused():
    with pytest.raises(ConfigError, match=r"^--compress powersgd:4 needs whole matrices: ") as info:
        CompressedAllReduce(parse_codec("powersgd:4"), 2, 100)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("none", None),
        ("fp16", CodecSpec("fp16")),
        ("BF16", CodecSpec("bf16")),
        (" int8 ", CodecSpec("int8")),
        ("topk:0.01", CodecSpec("topk", fraction=0.01)),
        ("topk:1", CodecSpec("topk", fraction=1.0)),
        ("powersgd:4", CodecSpec("powersgd", rank=4)),
    ],
)
def test_parse_codec(text, spec):
    assert parse_codec(text) == spec
    if spec is not None:
        assert parse_codec(str(spec)) == spec  # str() is the flag's text form


def test_spec_text_and_properties():
    assert [str(parse_codec(t)) for t in ("fp16", "topk:0.01", "powersgd:4")] == ["fp16", "topk:0.01", "powersgd:4"]
    assert [parse_codec(t).error_feedback for t in ("fp16", "bf16", "int8", "topk:0.5", "powersgd:1")] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert [parse_codec(t).needs_shapes for t in ("int8", "topk:0.5", "powersgd:1")] == [False, False, True]
    # The built-in codecs, first and in this order; a codec added as a file of its own comes after them.
    assert CODECS[:5] == ("fp16", "bf16", "int8", "topk:FRACTION", "powersgd:RANK")


CHOICES = "choose " + ", ".join(CODECS[:-1]) + " or " + CODECS[-1]  # every codec found (compression/spec.py)
BAD = [
    ("zip", "--compress: unknown codec 'zip'; " + CHOICES),
    ("", "--compress: unknown codec ''; " + CHOICES),
    ("topk:1.5", "--compress topk:1.5: the fraction must be in (0, 1]"),
    ("topk:0", "--compress topk:0: the fraction must be in (0, 1]"),
    ("topk:-0.1", "--compress topk:-0.1: the fraction must be in (0, 1]"),
    ("topk:nan", "--compress topk:nan: the fraction must be in (0, 1]"),
    ("topk:x", "--compress topk:x: the fraction must be a number in (0, 1]"),
    ("topk", "--compress topk: the fraction is missing; write topk:FRACTION, e.g. topk:0.01"),
    ("topk:", "--compress topk: the fraction is missing; write topk:FRACTION, e.g. topk:0.01"),
    ("powersgd:0", "--compress powersgd:0: the rank must be an integer >= 1"),
    ("powersgd:2.5", "--compress powersgd:2.5: the rank must be an integer >= 1"),
    ("powersgd:-1", "--compress powersgd:-1: the rank must be an integer >= 1"),
    ("powersgd", "--compress powersgd: the rank is missing; write powersgd:RANK, e.g. powersgd:4"),
    ("fp16:3", "--compress fp16:3: fp16 takes no argument; " + CHOICES),
    ("int8:", "--compress int8:: int8 takes no argument; " + CHOICES),
    ("none:1", "--compress: unknown codec 'none:1'; " + CHOICES),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_values_name_the_flag_on_one_line(text, message):
    with pytest.raises(ConfigError) as info:
        parse_codec(text)
    assert str(info.value) == message


def test_every_codec_error_is_one_line_naming_the_flag():
    """The parser's errors, a spec built directly with bad values, and PowerSGD without shapes."""
    raisers = [lambda t=t: parse_codec(t) for t, _ in BAD] + [
        lambda: CodecSpec("zip"),
        lambda: CodecSpec("topk"),
        lambda: CodecSpec("topk", fraction=2.0),
        lambda: CodecSpec("topk", rank=3),
        lambda: CodecSpec("powersgd"),
        lambda: CodecSpec("powersgd", rank=0),
        lambda: CodecSpec("powersgd", rank=2.5),
        lambda: CodecSpec("powersgd", fraction=0.1),
        lambda: CodecSpec("int8", rank=3),
        lambda: CodecSpec("powersgd", rank=3).build().encode(torch.zeros(4)),
        lambda: CompressedAllReduce(CodecSpec("powersgd", rank=3), 1, 4),
    ]
    for raise_it in raisers:
        with pytest.raises(ConfigError) as info:
            raise_it()
        message = str(info.value)
        assert "\n" not in message and message.startswith("--compress"), message


def test_import_does_not_load_torch():
    code = (
        "import sys\n"
        "import distrain.compression as c\n"
        "assert c.parse_codec('topk:0.1').fraction == 0.1\n"
        "try:\n"
        "    c.parse_codec('zip')\n"
        "except Exception as e:\n"
        "    assert type(e).__name__ == 'ConfigError'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_codec_s_summary_figures_and_report_text_come_from_its_own_spec_module():
    """summary.json's "compress"/"codec_ratio" and the report's " + CODEC" (issue 27: declared by the
    compression package, read by the summary and the report without naming the option)."""
    import pandas as pd

    from distrain.compression.spec import codec_figures, codec_settings_text

    steps = pd.DataFrame({"bytes_sent": [10, 30, 5], "bytes_uncompressed": [40, 120, None]})
    assert codec_figures(steps, {"compress": "int8"}) == {"compress": "int8", "codec_ratio": 4.0}
    assert codec_figures(steps[["bytes_sent"]], {"compress": "int8"}) == {"compress": "int8", "codec_ratio": None}
    assert codec_figures(steps, {"compress": None}) == {} and codec_figures(steps, {}) == {}
    assert codec_settings_text({"compress": "topk:0.01"}) == " + topk:0.01" and codec_settings_text({}) == ""
