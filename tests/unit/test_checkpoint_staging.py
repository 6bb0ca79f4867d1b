"""The staging buffers sharded checkpoints are written from (trainers/checkpoint_staging.py): a copy the
sources' later changes do not reach, kept from one save to the next; and AsyncSaver's saves over two
FSDP ranks reading back as the state was when each save returned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from distrain.trainers.checkpoint_staging import StagingBuffers


def test_staged_tensors_are_copies_kept_from_one_save_to_the_next():
    staging = StagingBuffers()
    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor(3.0, dtype=torch.float64)
    first = staging.stage({"a": a, "b": b})
    a.add_(10.0)  # training goes on: the staged copy keeps the value it had
    assert torch.equal(first["a"], torch.arange(6.0).reshape(2, 3)) and float(first["b"]) == 3.0
    second = staging.stage({"a": a, "b": b})
    assert second["a"] is first["a"]  # the same buffer, the new value copied in
    assert torch.equal(second["a"], torch.arange(6.0).reshape(2, 3) + 10.0)
    third = staging.stage({"a": torch.zeros(4)})  # a new shape: a new buffer; an entry gone: dropped
    assert third["a"] is not first["a"] and third["a"].shape == (4,) and set(staging._staged) == {"a"}


def test_sharded_saves_read_back_as_the_state_was_when_each_save_returned(tmp_path):
    script = Path(__file__).with_name("sharded_save_ranks.py")
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True, timeout=300)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["s0_equal"] and result["s1_equal"], result
    assert (result["s0_step"], result["s1_step"]) == (1.0, 2.0)
    assert result["buffers_reused"] and result["entries"] == 4 + 2 * 4 + 1, result
