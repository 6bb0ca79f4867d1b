"""The examples in examples/ run through the CLI as docs/tasks.md shows them, on small data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from distrain.cli import app

pytestmark = pytest.mark.usefixtures("ray_cluster")
runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(tmp_path: Path, *args: str) -> dict:
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["run", *args, "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    return json.loads((run_dir / "summary.json").read_text())


def test_char_lm_beats_the_unigram_baseline(tmp_path):
    summary = run(
        tmp_path,
        "--task", f"{EXAMPLES / 'char_lm.py'}:CharLM",
        "--task-arg", "max_bytes=60000", "--task-arg", "seq_len=32", "--task-arg", "dim=32", "--task-arg", "layers=1",
        "--optimizer", "adam", "--lr", "0.005", "--epochs", "2",
    )  # fmt: skip
    info = summary["task_info"]
    assert info["python"].count(".") == 2 and "standard-library files" in info["corpus"]
    assert summary["final_test_perplexity"] < info["unigram_test_perplexity"], summary
    assert summary["target"].startswith("val_perplexity<=")
    assert summary["final_val_perplexity"] < info["unigram_test_perplexity"], summary


def test_diabetes_regression_explains_the_variance(tmp_path):
    summary = run(
        tmp_path,
        "--task", f"{EXAMPLES / 'diabetes_regression.py'}:Diabetes",
        "--epochs", "30", "--batch-size", "16", "--optimizer", "adam", "--lr", "0.01",
    )  # fmt: skip
    assert summary["final_test_r2"] >= 0.4, summary
    assert summary["final_test_mae"] < 55  # in the target's units (the target's std is ~77)


def test_image_folder_over_png_files(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for split, n in (("train", 48), ("test", 16)):
        for label, channel in (("red", 0), ("blue", 2)):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 90, size=(12, 12, 3), dtype=np.uint8)
                pixels[..., channel] += 150
                Image.fromarray(pixels).save(folder / f"{i}.png")
    summary = run(
        tmp_path,
        "--task", f"{EXAMPLES / 'image_folder.py'}:ImageFolderTask", "--task-arg", f"root={root}",
        "--epochs", "4", "--batch-size", "8", "--optimizer", "adam", "--lr", "0.01",
    )  # fmt: skip
    assert summary["final_test_accuracy"] >= 0.9, summary
