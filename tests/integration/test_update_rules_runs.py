"""Issue 30 on real Ray actors (docs/optimization.md): gradient accumulation and clipping keep BSP's
algebra, and a task's own element-wise optimizer and scheduler run the same on both transports; through
`distrain run` and `distrain.fit`.

- BSP over the collective, N = 2 workers x k = 2 accumulation steps at B = 16, clipped to norm 0.1 (the
  gradient's is about 0.3), equals one worker at 64 clipped the same (the clip is of the all-reduced
  gradient), within 1e-5 (CLI), and so do one replica cut over --fsdp 2 workers at 2 x 16 and one cut
  into --pipeline-stages 2 at 2 x 32 (2 micro-batches each);
- a task's own Adam with a StepLR, declared element-wise, steps the same under BSP over the PS (the shards
  build it per slice) at 2 workers x k = 2 x 8 as over the collective at 2 x 16, within 1e-5, at the
  scheduler's rates (fit). (2 x 16 over the collective is one worker at 32: tests/integration/test_bsp.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset
from typer.testing import CliRunner

import distrain
from distrain.cli import app
from distrain.config import RunConfig
from distrain.orchestrator.run import run_training
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
BASE = dict(lr_scaling="none", lr=0.1, momentum=0.9, epochs=1, max_steps=6, seed=3, segment_steps=6, eval_every=0)
TOL = 1e-5


class AdamStepTask(distrain.Task):
    """A tiny regression whose own Adam halves its rate every 3 updates (importable by the workers)."""

    elementwise_optimizer = True

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def datasets(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 4, generator=g)
        y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])

    def loss(self, model, batch):
        x, y = batch
        return ((model(x).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self, params):
        optimizer = torch.optim.Adam(params, lr=0.02)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)



def test_accumulation_and_clipping_keep_bsp_equal_to_one_worker_at_the_global_batch(tmp_path):
    one_clipped = run_training(
        RunConfig(**BASE, workers=1, batch_size=64, clip_grad_norm=0.1, run_dir=str(tmp_path / "1c"))
    )
    one_plain = run_training(RunConfig(**BASE, workers=1, batch_size=64, run_dir=str(tmp_path / "1p")))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in BASE.items()]
    result = CliRunner().invoke(
        app,
        ["run", *flags, "--workers=2", "--batch-size=16", "--accumulate-steps=2", "--clip-grad-norm=0.1",
         f"--run-dir={tmp_path / 'cli'}"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    clipped, plain = final_params(one_clipped.run_dir), final_params(one_plain.run_dir)
    assert (clipped - plain).abs().max().item() > 1e-3  # the clip did bind
    assert (final_params(tmp_path / "cli") - clipped).abs().max().item() <= TOL
    rows = steps_of(tmp_path / "cli")
    assert len(rows) == 12 and (rows["samples"] == 32).all()  # one row per update, k x B samples each
    # One replica cut over D = 2 FSDP workers, k = 2: FSDP reduces in the last micro-batch only, and the
    # clip's norm is gathered over the two shards.
    fsdp = run_training(
        RunConfig(**BASE, workers=1, fsdp=2, batch_size=16, accumulate_steps=2, clip_grad_norm=0.1,
                  run_dir=str(tmp_path / "fsdp"))
    )  # fmt: skip
    assert fsdp.summary["global_batch_size"] == 64
    assert (final_params(fsdp.run_dir) - clipped).abs().max().item() <= TOL
    # One replica cut into S = 2 pipeline stages, k = 2 x M = 2 micro-batches of 16 in one schedule, the
    # clip's norm summed over the stages.
    pipe = run_training(
        RunConfig(**BASE, workers=1, pipeline_stages=2, microbatches=2, batch_size=32, accumulate_steps=2,
                  clip_grad_norm=0.1, run_dir=str(tmp_path / "pipe"))
    )  # fmt: skip
    assert pipe.summary["status"] == "completed"
    assert (final_params(pipe.run_dir) - clipped).abs().max().item() <= TOL


def test_tensor_parallel_replicas_accumulate_and_clip_as_one_worker_at_the_global_batch(tmp_path):
    """The cnn at --tensor-parallel 2 (its hybrid plan: each worker on its own samples, the classifier
    split; global batch T x k x B): k = 2 micro-steps of 16 equal one worker at 64, and clipped to 0.1,
    k = 1 at 32, one worker at 64 clipped alike (the norm counts the split classifier's halves once and
    the convolutions' gradients, which both workers hold, once); the clip binds. Then the mlp (its two
    workers share each slice) cut --fsdp 2 x --tensor-parallel 2 and a pipeline of --fsdp 2 sharded
    stages, both at k = 2 and clipped, against one worker: the norm over FSDP shards of tensor-parallel
    halves, and over the stages' shards."""
    one = {
        name: run_training(RunConfig(**BASE, workers=1, batch_size=64, run_dir=str(tmp_path / name), **kw))
        for name, kw in (("plain", {}), ("clipped", {"clip_grad_norm": 0.1}))
    }
    ends = {name: final_params(run.run_dir) for name, run in one.items()}
    assert (ends["clipped"] - ends["plain"]).abs().max().item() > 1e-3  # the clip did bind
    accumulated = run_training(
        RunConfig(**BASE, workers=1, tensor_parallel=2, batch_size=16, accumulate_steps=2,
                  run_dir=str(tmp_path / "t2k2"))
    )  # fmt: skip
    assert accumulated.summary["global_batch_size"] == 64
    assert (final_params(accumulated.run_dir) - ends["plain"]).abs().max().item() <= TOL
    clipped = run_training(
        RunConfig(**BASE, workers=1, tensor_parallel=2, batch_size=32, clip_grad_norm=0.1,
                  run_dir=str(tmp_path / "t2c"))
    )  # fmt: skip
    assert (final_params(clipped.run_dir) - ends["clipped"]).abs().max().item() <= TOL
    mlp = BASE | {"model": "mlp", "clip_grad_norm": 0.1}
    one_mlp = run_training(RunConfig(**mlp, workers=1, batch_size=64, run_dir=str(tmp_path / "m1")))
    reference = final_params(one_mlp.run_dir)
    layouts = {
        "d2t2": dict(fsdp=2, tensor_parallel=2, batch_size=16),
        "s2d2": dict(fsdp=2, pipeline_stages=2, microbatches=2, batch_size=16),
    }
    for name, layout in layouts.items():
        run = run_training(RunConfig(**mlp, **layout, workers=1, accumulate_steps=2, run_dir=str(tmp_path / name)))
        assert run.summary["global_batch_size"] == 64, name
        assert (final_params(run.run_dir) - reference).abs().max().item() <= TOL, name


def test_a_task_elementwise_optimizer_and_scheduler_run_alike_on_both_transports_with_accumulation(tmp_path):
    """Over the collective at 2 x 16; over the PS at 2 x k = 2 x 8: the same global batch of 32."""
    common = dict(task=AdamStepTask, workers=2, epochs=1, seed=1, segment_steps=6, eval_every=0, progress=False)
    runs = {
        "collective": distrain.fit(**common, batch_size=16, run_dir=str(tmp_path / "collective")),
        "ps": distrain.fit(**common, batch_size=8, accumulate_steps=2, strategy="bsp", transport="ps",
                           run_dir=str(tmp_path / "ps")),
    }  # fmt: skip
    assert all(r.status == "completed" and r.summary["steps_completed"] == 6 for r in runs.values())
    assert runs["ps"].summary["global_batch_size"] == 32
    collective, ps = (final_params(tmp_path / t) for t in ("collective", "ps"))
    assert (collective - ps).abs().max().item() <= TOL
    rates = steps_of(tmp_path / "collective").groupby("step")["lr"].first().tolist()
    assert rates == pytest.approx([0.02] * 3 + [0.01] * 3)  # the task's StepLR, not --lr's schedule
    rows = steps_of(tmp_path / "ps")
    assert len(rows) == 12 and (rows["samples"] == 16).all()  # one row per update, k x B samples each


def test_a_ps_run_with_its_own_scheduler_resumes_at_the_scheduler_s_position(tmp_path):
    """BSP over the PS (2 shards) with the task's Adam and StepLR (halved every 3 updates): 4 updates,
    then --resume to 10, ends where the run taken straight through to 10 does (the shards' scheduler
    state rides in the checkpoint's "ps" counters). Without it the resumed shards would start the
    schedule again at 0.02 for updates 5 and 6, and the ends differ."""
    from distrain.orchestrator.checkpoint import load_checkpoint
    from distrain.orchestrator.resume import resume_config

    common = dict(task=AdamStepTask, workers=2, epochs=2, seed=1, batch_size=16, segment_steps=4, eval_every=0,
                  strategy="bsp", transport="ps", ps_shards=2, progress=False)  # fmt: skip
    straight = distrain.fit(**common, max_steps=10, run_dir=str(tmp_path / "straight"))
    first = distrain.fit(**common, max_steps=4, run_dir=str(tmp_path / "parts"))
    ps = load_checkpoint(Path(first.run_dir) / "checkpoints" / "final.pt")["ps"]
    assert ps["version"] == 4 and ps["scheduler"]["last_epoch"] == 4 and ps["scheduler"]["_last_lr"] == [0.01]
    resumed = run_training(resume_config(first.run_dir, {"max_steps": 10}), resume=True)
    assert straight.summary["steps_completed"] == resumed.summary["steps_completed"] == 10
    assert torch.equal(final_params(resumed.run_dir), final_params(straight.run_dir))


@pytest.mark.parametrize("layout", [{"workers": 2}, {"workers": 1, "fsdp": 2}], ids=["replicas", "fsdp"])
def test_a_replica_run_with_its_own_scheduler_resumes_at_the_scheduler_s_position(tmp_path, layout):
    """BSP over the collective with the task's Adam and StepLR (halved every 3 updates), plain replicas
    and one replica cut over --fsdp 2 (the scheduler's state in the shards' reference): 4 updates, then
    --resume to 10, at the straight run's rates (the lr column) and to its end."""
    from distrain.orchestrator.resume import resume_config

    common = dict(task=AdamStepTask, epochs=2, seed=1, batch_size=16, segment_steps=4, eval_every=0, progress=False)
    straight = distrain.fit(**common, **layout, max_steps=10, run_dir=str(tmp_path / "straight"))
    first = distrain.fit(**common, **layout, max_steps=4, run_dir=str(tmp_path / "parts"))
    resumed = run_training(resume_config(first.run_dir, {"max_steps": 10}), resume=True)
    assert resumed.summary["steps_completed"] == 10
    rates = {name: steps_of(run.run_dir).groupby("step")["lr"].first() for name, run in
             (("straight", straight), ("resumed", resumed))}  # fmt: skip
    assert rates["resumed"].tolist() == pytest.approx([0.02] * 3 + [0.01] * 3 + [0.005] * 3 + [0.0025])
    assert rates["straight"].tolist() == rates["resumed"].tolist()
    assert (final_params(resumed.run_dir) - final_params(straight.run_dir)).abs().max().item() <= TOL
