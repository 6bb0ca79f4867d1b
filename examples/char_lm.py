"""A character-level transformer language model on Python's own standard-library sources.

Every machine with Python has this corpus, so the example needs no download. The files are a pinned
list (read from the running interpreter's standard library; the Python version and a digest of the
text are recorded in the run's summary under `task_info`), cut to `max_bytes`. Samples are
non-overlapping windows of `seq_len` bytes; the model predicts each next byte. The last tenth of the
text is the test set; --val-fraction of the training windows is the validation split. Reported: loss
(mean NLL per byte, nats) and perplexity = exp(loss), against the unigram baseline (each byte
predicted from the training text's byte frequencies).

    distrain run --task examples/char_lm.py:CharLM --optimizer adam --lr 0.003 --epochs 4

The model is an `nn.Sequential` of (embedding, blocks..., head), so it can be cut between blocks
(`split_points`) by the pipeline strategies.
"""

from __future__ import annotations

import hashlib
import math
import platform
import sysconfig
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import distrain

FILES = (  # pinned: the same text on every machine with the same Python version
    "argparse.py", "calendar.py", "contextlib.py", "dataclasses.py", "difflib.py", "enum.py",
    "fractions.py", "functools.py", "heapq.py", "pprint.py", "queue.py", "shlex.py", "statistics.py",
    "string.py", "textwrap.py", "bisect.py",
)  # fmt: skip
VOCAB = 256  # bytes


def corpus(max_bytes: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((root / name).read_bytes() for name in FILES)
    return text[:max_bytes]


class Windows(Dataset):
    """Non-overlapping windows of `seq_len + 1` bytes: (input bytes, next bytes)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1]
        return chunk[:-1], chunk[1:]

    def get_batch(self, indices):  # one gather for the whole batch
        idx = torch.as_tensor(indices, dtype=torch.int64)
        offsets = idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        chunk = self.data[offsets]
        return chunk[:, :-1], chunk[:, 1:]


class Embed(nn.Module):
    def __init__(self, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, dim)
        self.positions = nn.Parameter(torch.zeros(seq_len, dim))
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions[: x.shape[1]]


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v and output projections, so tensor
    parallelism can split it Megatron style: q, k, v column-wise (each worker computes whole heads of
    its own), the output row-wise. The head count is read from the projections' width (`-1` below), so
    the same code runs on a worker's share of the heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:
            return proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)

        out = nn.functional.scaled_dot_product_attention(heads(self.q), heads(self.k), heads(self.v), is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP (no dropout: the loss is deterministic)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharLM(distrain.Task):
    carve_validation = True  # --val-fraction of the training windows is the validation split

    def __init__(self, max_bytes: int = 300_000, seq_len: int = 64, dim: int = 64, layers: int = 2, heads: int = 4):
        self.max_bytes, self.seq_len, self.dim, self.layers, self.heads = max_bytes, seq_len, dim, layers, heads
        text = corpus(max_bytes)
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
        self.cut = int(len(self.data) * 0.9)
        self.digest = hashlib.sha256(text).hexdigest()[:16]
        self.unigram_perplexity = unigram_perplexity(self.data[: self.cut], self.data[self.cut :])
        # The example's quality bar: half the unigram baseline's perplexity.
        self.default_target = f"val_perplexity<={self.unigram_perplexity / 2:.3f}"

    def build_model(self) -> nn.Module:
        blocks = [Block(self.dim, self.heads) for _ in range(self.layers)]
        return nn.Sequential(Embed(self.dim, self.seq_len), *blocks, Head(self.dim))

    def datasets(self):
        return Windows(self.data[: self.cut], self.seq_len), Windows(self.data[self.cut :], self.seq_len)

    def forward(self, model, batch):
        return model(batch[0])

    def criterion(self, logits, batch):
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))

    def derived_metrics(self, means):
        return {"perplexity": math.exp(means["loss"])}

    def tensor_parallel_plan(self, tp):
        """--tensor-parallel T: each block's attention heads and MLP split T ways (embeddings, norms and
        the output head stay whole)."""
        if self.heads % tp:
            raise ValueError(f"its {self.heads} attention heads do not split {tp} ways")
        plan = {}
        for i in range(1, self.layers + 1):  # model[0] is the embedding, model[layers + 1] the head
            plan |= {f"{i}.attn.{p}": "colwise" for p in "qkv"} | {f"{i}.attn.o": "rowwise"}
            plan |= {f"{i}.mlp.0": "colwise", f"{i}.mlp.2": "rowwise"}
        return plan

    def split_points(self):
        return [str(i) for i in range(1, self.layers + 2)]  # before each block and before the head

    def describe(self):
        return {
            "corpus": f"{len(FILES)} standard-library files, {len(self.data):,} bytes, sha256 {self.digest}",
            "python": platform.python_version(),
            "unigram_test_perplexity": round(self.unigram_perplexity, 4),
        }


def unigram_perplexity(train: torch.Tensor, test: torch.Tensor) -> float:
    """exp(cross-entropy) of the test bytes under the training bytes' frequencies (add-one smoothed)."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1
    log_p = (counts / counts.sum()).log()
    return math.exp(float(-log_p[test].mean()))
