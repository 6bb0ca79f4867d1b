"""Cut replicas end to end, torch's FSDP2 and tensor parallelism over real gloo groups in real Ray actors:
--fsdp D = 4 and R = 2 x D = 2 (HSDP) equal one process at the same global batch under momentum SGD and
AdamW, each worker holds a quarter of the state, a run resumes at another D with the same global batch,
a model three times a worker's budget trains at D = 4; --tensor-parallel T = 2 (the mlp, the char
transformer) and D = 2 x T = 2 equal one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distrain.config import RunConfig
from distrain.errors import ConfigError, ResourceError
from distrain.orchestrator.callbacks import Callback
from distrain.orchestrator.checkpoint import load_checkpoint
from distrain.orchestrator.resume import resume_config
from distrain.orchestrator.run import run_training
from distrain.orchestrator.trained_model import load_model
from tests.helpers import final_params, steps_of

pytestmark = pytest.mark.usefixtures("ray_cluster")
HERE = Path(__file__).resolve().parents[1]  # tests/
BASE = dict(model="mlp", lr_scaling="none", epochs=1, max_steps=20, seed=3, segment_steps=10, eval_every=0)
# AdamW at a small rate: Adam divides by sqrt(v), so at lr 0.05 even plain BSP over 4 workers ends 1.6e-4
# from one process (float sums in another order, amplified where v is near 0); at 2e-3 both are ~1e-6.
OPTIMIZERS = {"sgd": dict(optimizer="sgd", momentum=0.9, lr=0.05), "adamw": dict(optimizer="adamw", lr=2e-3)}
TOL = 1e-5
MLP_PARAMS = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10


def cfg(tmp_path, name: str, optimizer: str = "sgd", **kw) -> RunConfig:
    return RunConfig(**(BASE | OPTIMIZERS[optimizer] | {"run_dir": str(tmp_path / name)} | kw))



@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process at the global batch 64, under each optimizer: its final parameters and step rows."""
    base = tmp_path_factory.mktemp("one")
    runs = {name: run_training(cfg(base, name, name, workers=1, batch_size=64)) for name in OPTIMIZERS}
    return {name: (final_params(run.run_dir), steps_of(run.run_dir)) for name, run in runs.items()}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_four_shards_equal_one_process_and_hold_a_quarter_each(tmp_path, one_process, optimizer):
    run = run_training(cfg(tmp_path, "d4", optimizer, workers=1, fsdp=4, batch_size=16))
    assert run.summary["status"] == "completed"
    assert (final_params(run.run_dir) - one_process[optimizer][0]).abs().max().item() <= TOL
    assert run.summary["layout"] == {
        "replicas": 1, "fsdp": 4, "tensor_parallel": 1, "pipeline_stages": 1, "workers_per_replica": 4,
        "worker_actors": 4,
    }  # fmt: skip
    assert run.summary["global_batch_size"] == 64
    rows = steps_of(run.run_dir)
    assert (rows.groupby("step").size() == 4).all() and rows["samples"].sum() == 20 * 64
    assert rows.groupby("worker")["shard"].first().tolist() == [0, 1, 2, 3] and (rows["replica"] == 0).all()
    # The four workers' losses on their own 16 samples average to one process's loss on all 64.
    mean_loss = rows.groupby("step")["loss"].mean().to_numpy()
    assert abs(mean_loss - one_process[optimizer][1]["loss"].to_numpy()).max() <= TOL
    # Each worker holds its shards: a quarter of the parameters, gradients and optimizer state (FSDP2 cuts
    # each tensor's rows in 4; the last classifier's 10 rows go 3, 3, 3, 1), together the whole model.
    held = rows.groupby("worker")[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].max()
    whole = MLP_PARAMS * 4
    assert held["mem_param_bytes"].sum() == whole and (held["mem_param_bytes"] <= 1.25 * whole / 4).all()
    assert (rows.groupby("worker")["mem_peak_bytes"].min() > 0).all()  # every worker's, sharded ones too
    assert (held["mem_grad_bytes"] == held["mem_param_bytes"]).all()
    moments = 1 if optimizer == "sgd" else 2  # momentum buffer; Adam's two moments
    steps = 0 if optimizer == "sgd" else 6 * 4  # AdamW's step count: a float32 scalar per parameter tensor
    assert (held["mem_optim_bytes"] == moments * held["mem_param_bytes"] + steps).all()
    # FSDP's traffic per worker and step: 2 all-gathers and a reduce-scatter of 3/4 of the parameters each.
    assert (rows["bytes_sent"] == 3 * 3 * whole // 4).all()


def test_two_sharded_replicas_equal_one_process_on_the_global_batch(tmp_path, one_process):
    run = run_training(cfg(tmp_path, "r2d2", workers=2, fsdp=2, batch_size=16))
    assert (final_params(run.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    # rank = replica x D + shard, and data-parallel rank (r, d) takes slice r x D + d.
    placed = rows.groupby("worker")[["replica", "shard", "slice"]].first().values.tolist()
    assert placed == [[0, 0, 0], [0, 1, 1], [1, 0, 2], [1, 1, 3]]
    assert run.summary["layout"]["worker_actors"] == 4 and run.summary["global_batch_size"] == 64
    half = MLP_PARAMS * 4 // 2
    assert (rows["mem_param_bytes"] <= 1.25 * half).all()


def test_a_sharded_run_resumes_at_another_fsdp_with_the_same_global_batch(tmp_path, one_process):
    """--fsdp 4 --batch-size 16 for 10 steps, then --resume at --fsdp 2 --batch-size 32: the first resumed
    step's loss is the uninterrupted run's, and the end is one process's (the checkpoint holds the whole
    model and momentum; the global batch, so the data order, is the same)."""
    first = run_training(cfg(tmp_path, "d4", workers=1, fsdp=4, batch_size=16, max_steps=10))
    assert first.summary["steps_completed"] == 10
    with pytest.raises(ConfigError, match=r"--resume cannot change --fsdp here: the global batch .* from 64 to 32"):
        resume_config(first.run_dir, {"fsdp": 2})
    resumed = run_training(resume_config(first.run_dir, {"fsdp": 2, "batch_size": 32, "max_steps": 20}), resume=True)
    assert resumed.summary["status"] == "completed" and resumed.summary["layout"]["fsdp"] == 2
    assert (final_params(resumed.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    rows = steps_of(resumed.run_dir)
    after = rows[rows["step"] >= 10]
    assert sorted(set(after["worker"])) == [0, 1] and (after["samples"] == 32).all()
    expected = one_process["sgd"][1].set_index("step")["loss"]
    assert abs(after[after["step"] == 10]["loss"].mean() - expected[10]) <= TOL


def test_sharded_checkpoints_are_the_workers_shards_and_load_whole_or_at_another_layout(tmp_path, one_process):
    """--fsdp 2 --batch-size 32 with --checkpoint-steps 5 for 10 steps: every checkpoint file points at a
    folder of DCP shards, one file per worker (nobody gathered the model), the rows after which one was
    taken record the seconds it blocked; `load_model` reads the final one whole. --resume without
    sharding (2 plain replicas at B = 32, the same global batch) reads the shards whole and goes on from
    the same loss to one process's end."""
    first = run_training(cfg(tmp_path, "d2", workers=1, fsdp=2, batch_size=32, max_steps=10, checkpoint_steps=5))
    checkpoints = Path(first.run_dir) / "checkpoints"
    for name, step in (("step-00000005.pt", 5), ("final.pt", 10)):
        payload = load_checkpoint(checkpoints / name)
        assert "model" not in payload and "optimizer" not in payload
        assert payload["sharded"]["dir"] == f"state-{step:08d}" and payload["sharded"]["finite"] is True
        shards = sorted(p.name for p in (checkpoints / payload["sharded"]["dir"]).iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    rows = steps_of(first.run_dir)
    blocked = rows.dropna(subset=["ckpt_block_s"])
    assert sorted(set(blocked["step"])) == [4, 9] and len(blocked) == 4 and (blocked["ckpt_block_s"] >= 0).all()
    figure = first.summary["checkpoint_blocking_s"]
    assert figure["saves"] == 2 and figure["max"] == blocked["ckpt_block_s"].max() > 0
    model = load_model(first.run_dir)
    loaded = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    assert torch.equal(loaded, final_params(first.run_dir))
    resumed = run_training(
        resume_config(first.run_dir, {"fsdp": 1, "workers": 2, "batch_size": 32, "max_steps": 20}), resume=True
    )
    assert resumed.summary["layout"]["fsdp"] == 1
    assert (final_params(resumed.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    after = steps_of(resumed.run_dir)
    expected = one_process["sgd"][1].set_index("step")["loss"]
    assert abs(after[after["step"] == 10]["loss"].mean() - expected[10]) <= TOL


def test_a_sharded_run_that_loses_a_worker_restarts_from_its_shards(tmp_path, one_process):
    """A worker killed after step 8 of an --fsdp 2 run with step checkpoints every 5: the run restarts
    from the step-5 shards (each new worker reads its own pieces, momentum included) and ends where one
    process ends."""
    hit = run_training(
        cfg(tmp_path, "hit", workers=1, fsdp=2, batch_size=32, checkpoint_steps=5, chaos=("kill-worker@8:1",))
    )
    (event,) = hit.summary["failure_events"]
    assert hit.summary["status"] == "completed" and (event["action"], event["restored_step"]) == ("restarted", 5)
    assert (final_params(hit.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL


def test_a_sharded_run_stopped_by_a_callback_between_checkpoints_saves_its_last_step(tmp_path):
    """A callback stops the run at its first rows: the end moves to the last step handed out, where no
    checkpoint was due, so the driver has every worker save its shards there; final.pt is that step's
    state, the model one process reaches in as many steps."""

    class StopEarly(Callback):
        def on_rows(self, rows):
            return True

    stopped = run_training(
        cfg(tmp_path, "d2", workers=1, fsdp=2, batch_size=32, segment_steps=4), callbacks=[StopEarly()]
    )
    steps = stopped.summary["steps_completed"]
    assert stopped.summary["status"] == "stopped" and steps < 20
    final = load_checkpoint(Path(stopped.run_dir) / "checkpoints" / "final.pt")
    assert final["global_step"] == steps and final["sharded"]["dir"] == f"state-{steps:08d}"
    one = run_training(cfg(tmp_path, "one", workers=1, batch_size=64, max_steps=steps))
    assert (final_params(stopped.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL


def test_a_tensor_parallel_run_resumes_in_one_process(tmp_path, one_process):
    """T = 2 for 10 steps (its checkpoint: each worker's column and row halves, as DCP shards), then
    --resume at T = 1: one process reads them whole and continues from the same loss to the same end."""
    first = run_training(cfg(tmp_path, "t2", workers=1, tensor_parallel=2, batch_size=64, max_steps=10))
    resumed = run_training(resume_config(first.run_dir, {"tensor_parallel": 1, "max_steps": 20}), resume=True)
    assert resumed.summary["layout"]["worker_actors"] == 1
    assert (final_params(resumed.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    after = steps_of(resumed.run_dir)
    assert abs(after[after["step"] == 10]["loss"].iloc[0] - one_process["sgd"][1].set_index("step")["loss"][10]) <= TOL


def test_a_model_three_times_one_workers_budget_trains_at_four_shards(tmp_path):
    """WideMLP(width 64): 4 blocks of 4160 parameters, under Adam 5 copies each (θ, gradient, a buffer, two
    moments): 325 KiB in one worker against --worker-memory 100KiB. Refused at D = 1 and D = 2 naming
    D = 4 (a quarter of the copies plus one block gathered whole: 97.5 KiB), which trains; each worker then
    measurably holds a quarter of the unsharded parameter, gradient and Adam bytes."""
    wide = dict(
        task=f"{HERE / 'pipeline_task.py'}:WideMLP", task_args={"width": 64, "samples": 160}, optimizer="adam",
        lr=1e-3, workers=1, batch_size=8, epochs=1, eval_every=0, segment_steps=3, worker_memory="100KiB",
    )  # fmt: skip
    for shards, what in ((1, "one worker"), (2, "each of a replica's 2 shards")):
        refused = rf"^{what} would hold .*; (--pipeline-stages 4 .* or )?--fsdp 4 shards it"
        with pytest.raises(ResourceError, match=refused):
            run_training(RunConfig(**wide, fsdp=shards, run_dir=str(tmp_path / f"d{shards}")))
        assert not (tmp_path / f"d{shards}").exists()
    run = run_training(RunConfig(**wide, fsdp=4, run_dir=str(tmp_path / "d4")))
    assert run.summary["status"] == "completed" and run.summary["steps_completed"] == 3
    rows = steps_of(run.run_dir)
    held = rows[["mem_param_bytes", "mem_grad_bytes", "mem_optim_bytes"]].sum(axis=1)
    unsharded = 4 * 4160 * 4 * (1 + 1 + 2)
    assert held.max() <= 1.25 * unsharded / 4 and held.min() >= unsharded / 4 * 0.75, held.tolist()


@pytest.mark.parametrize("fsdp", [1, 2])
def test_tensor_parallel_mlp_equals_one_process(tmp_path, one_process, fsdp):
    """T = 2 splits the mlp's first Linear by columns and its second by rows; its two workers share one
    slice of the samples. Alone (global batch 64 = B) and under D = 2 (64 = 2 x 32): one process's end."""
    run = run_training(cfg(tmp_path, f"t2d{fsdp}", workers=1, fsdp=fsdp, tensor_parallel=2, batch_size=64 // fsdp))
    assert (final_params(run.run_dir) - one_process["sgd"][0]).abs().max().item() <= TOL
    rows = steps_of(run.run_dir)
    assert run.summary["layout"]["worker_actors"] == 2 * fsdp and run.summary["global_batch_size"] == 64
    # rank = shard x T + tp: a shard's two tensor-parallel workers read its slice; the first counts it.
    placed = rows.groupby("worker")[["shard", "tp", "slice"]].first().values.tolist()
    assert placed == [[d, t, d] for d in range(fsdp) for t in range(2)]
    assert rows.groupby("step")["samples"].sum().eq(64).all() and (rows[rows["tp"] == 1]["samples"] == 0).all()
    by_step = rows.pivot_table(index="step", columns=["shard", "tp"], values="loss")
    for d in range(fsdp):
        assert (by_step[(d, 0)] - by_step[(d, 1)]).abs().max() <= 1e-6  # one slice, one loss
    # Each worker holds half of the split layers (the classifier stays whole), then 1/D of that.
    held = (64 * 256 + 256) // 2 + 256 * 256 // 2 + 256 + 256 * 10 + 10
    assert rows.groupby("worker")["mem_param_bytes"].max().sum() == 2 * held * 4


def test_tensor_parallel_char_transformer_equals_one_process(tmp_path):
    """The example's transformer at T = 2: q, k, v column-wise (two heads each), the attention output and
    the MLP's second Linear row-wise; 6 steps of momentum SGD, against one process. (Under AdamW both
    end 2e-5 apart at lr 2e-3: Adam's 1/sqrt(v) amplifies the float sums' other order where v is tiny,
    as it does for plain BSP against one process.)"""
    lm = dict(
        task=f"{HERE.parent / 'examples' / 'char_lm.py'}:CharLM", optimizer="sgd", momentum=0.9, lr=0.05, workers=1,
        batch_size=8, epochs=1, max_steps=6, segment_steps=6, eval_every=0, seed=3,
        task_args={"max_bytes": 20_000, "seq_len": 16, "dim": 32, "layers": 1, "heads": 4},
    )  # fmt: skip
    one = run_training(RunConfig(**lm, run_dir=str(tmp_path / "one")))
    two = run_training(RunConfig(**lm, tensor_parallel=2, run_dir=str(tmp_path / "t2")))
    assert (final_params(two.run_dir) - final_params(one.run_dir)).abs().max().item() <= TOL
    with pytest.raises(
        ConfigError, match=r"^--tensor-parallel 8 does not fit .*: its 4 attention heads do not split 8"
    ):
        run_training(RunConfig(**lm, tensor_parallel=8, run_dir=str(tmp_path / "t8")))


def test_diloco_over_sharded_replicas_equals_diloco_over_plain_replicas_at_twice_the_batch(tmp_path):
    """R = 2 replicas of D = 2 FSDP workers at B = 16 against 2 plain replicas at B = 32: each replica's
    inner steps take the same 32 samples, the outer steps average the same pseudo-gradients (part by part
    across the replicas' matching shards), Nesterov outer momentum included; 12 steps, H = 4."""
    lm = dict(strategy="diloco", sync_every=4, max_steps=12, optimizer="sgd", momentum=0.9, lr=0.05)
    plain = run_training(cfg(tmp_path, "plain", **(lm | dict(workers=2, batch_size=32))))
    cut = run_training(cfg(tmp_path, "cut", **(lm | dict(workers=2, fsdp=2, batch_size=16))))
    assert cut.summary["status"] == "completed" and cut.summary["outer_steps"] == 3
    assert (final_params(cut.run_dir) - final_params(plain.run_dir)).abs().max().item() <= TOL
    # Stopped after 8 steps and resumed: each worker reads its part of the outer optimizer's momentum
    # back from the shards, so the end is the uninterrupted run's. (Inner SGD without momentum: a
    # checkpoint holds one replica's inner optimizer state, as under plain DiLoCo, strategies/diloco.py.)
    stateless = lm | dict(workers=2, fsdp=2, batch_size=16, momentum=0.0)
    whole = run_training(cfg(tmp_path, "whole", **stateless))
    stopped = run_training(cfg(tmp_path, "cut8", **(stateless | dict(max_steps=8))))
    resumed = run_training(resume_config(stopped.run_dir, {"max_steps": 12}), resume=True)
    assert resumed.summary["outer_steps"] == 3
    assert (final_params(resumed.run_dir) - final_params(whole.run_dir)).abs().max().item() <= TOL
    rows = steps_of(cut.run_dir)
    # A step that ends with an outer step also moves the worker's part of the pseudo-gradient across the
    # two replicas: 2(R-1)/R = 1 x the bytes of the part it holds.
    inner = rows[rows["step"] == 0].set_index("worker")["bytes_sent"]
    for step in (3, 7, 11):
        outer = rows[rows["step"] == step].set_index("worker")
        assert ((outer["bytes_sent"] - inner) == outer["mem_param_bytes"]).all(), step
