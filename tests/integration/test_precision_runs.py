"""--precision: autocast forward passes, fp16's loss scale, its skip decision, and the GPU checks.

Unit tests (no Ray) pin the pieces; the integration tests run BSP with fp16 on a task whose gradient
overflows fp16 at the starting scale, and bf16 on the bundled data.
"""

from __future__ import annotations

import pytest

import distrain
from distrain.trainers.task import ClassificationTask
from tests.unit.test_precision import steps

# ---------------------------------------------------------------------------------------- real runs


class LoudDigits(ClassificationTask):
    """The bundled digits MLP with a loss 1e4 times larger (and so 1e4 times smaller an lr)."""

    def __init__(self):
        super().__init__(model="mlp")

    def criterion(self, output, batch):
        return super().criterion(output, batch) * 1e4


@pytest.mark.integration
@pytest.mark.usefixtures("ray_cluster")
def test_fp16_bsp_skips_the_same_overflowing_steps_on_every_replica_and_still_trains(tmp_path):
    from distrain.orchestrator.checkpoint import load_checkpoint

    result = distrain.fit(
        task=LoudDigits, precision="fp16", workers=2, epochs=3, lr=5e-6, momentum=0.9, eval_every=1,
        run_dir=str(tmp_path / "fp16"), progress=False,
    )  # fmt: skip
    df = steps(result.run_dir)
    skipped = df[df["nonfinite"].fillna(False).astype(bool)]
    # The starting scale 2**16 overflows this loss's fp16 backward: the first steps are skipped, then the
    # scale fits. Each replica decided on the all-reduced gradient, so both skipped exactly these steps.
    by_worker = skipped.groupby("worker")["step"].apply(sorted).to_dict()
    assert set(by_worker) == {0, 1} and by_worker[0] == by_worker[1] and len(by_worker[0]) >= 3, by_worker
    assert result.status == "completed" and result.summary["nonfinite_steps"] == len(by_worker[0])
    # ... each marked an fp16 overflow (issue 26: those are normal, not skipped updates that end a run diverged)
    assert skipped["overflow"].eq(True).all() and result.summary["overflow_steps"] == len(by_worker[0])
    assert result.metrics["test_accuracy"] >= 0.9, result.metrics
    final = load_checkpoint(result.run_dir / "checkpoints" / "final.pt")
    assert final["scaler"]["overflows"] == len(by_worker[0])
    assert final["scaler"]["scale"] == 2.0**16 / 2 ** len(by_worker[0])  # 3 epochs < 2000 clean steps: no growth


@pytest.mark.integration
@pytest.mark.usefixtures("ray_cluster")
def test_bf16_trains_the_bundled_digits_like_fp32(tmp_path):
    result = distrain.fit(
        model="mlp", precision="bf16", workers=2, epochs=4, eval_every=4, run_dir=str(tmp_path / "bf16"),
        progress=False,
    )  # fmt: skip
    assert result.status == "completed" and result.metrics["test_accuracy"] >= 0.93, result.metrics
    assert not steps(result.run_dir)["nonfinite"].fillna(False).any()


