"""Cutting a model into pipeline stages, and the pipeline's pure helpers (no Ray, no process groups)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from distrain.errors import ConfigError
from distrain.strategies.pipeline import bubble_fraction, model_inputs, split_batch
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.optim_state import FlatOptimizerState
from distrain.trainers.pipeline_split import balanced_bounds, plan_stages, stage_module
from distrain.trainers.task import ClassificationTask


def brute_force_best(sizes, candidates, stages):
    """The least largest-stage count over every choice of S - 1 cuts among the candidates."""
    best = None
    for cuts in itertools.combinations(candidates, stages - 1):
        points = [0, *cuts, len(sizes)]
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(points))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_bounds_minimise_the_largest_stage(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 9, (1,), generator=g))
    sizes = [int(v) for v in torch.randint(0, 1000, (n,), generator=g)]
    candidates = sorted(set(int(v) for v in torch.randint(1, n, (n - 1,), generator=g)))
    for stages in range(1, len(candidates) + 2):
        bounds = balanced_bounds(sizes, candidates, stages)
        assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in itertools.pairwise(bounds))
        assert all(b in candidates for _, b in bounds[:-1])  # cuts only where allowed
        assert max(sum(sizes[a:b]) for a, b in bounds) == brute_force_best(sizes, candidates, stages)


def test_more_stages_than_cuts_is_one_line():
    # the trainers' words; the pipeline strategy prefixes its flag (test below, and test_cli_errors.py)
    with pytest.raises(ConfigError, match=r"^pipeline 4 needs 3 cuts but the model has 2 places") as raised:
        balanced_bounds([1, 2, 3], [1, 2], 4)
    assert raised.value.detail.startswith(" 4 needs 3 cuts")


def test_split_points_choose_where_to_cut_and_unknown_ones_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plan = plan_stages(model, ["4"], 2)  # only before the head
    assert plan.bounds == ((0, 4), (4, 5))
    with pytest.raises(ConfigError, match="split_points\\(\\) names 'x'"):
        plan_stages(model, ["x"], 2)
    with pytest.raises(ConfigError, match="nn.Sequential"):
        plan_stages(nn.Linear(2, 2), [], 2)


def test_tied_weights_are_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(ConfigError, match="tied weights"):
        plan_stages(nn.Sequential(a, nn.ReLU(), b), [], 2)


def test_stages_keep_the_full_models_names_and_their_flat_vectors_concatenate_to_the_full_one():
    """What checkpoints rely on: stage state dicts merge into the full one, and the stages' flat
    parameter and optimizer vectors, in stage order, are the full model's (so restore to any S)."""
    torch.manual_seed(0)
    model = ClassificationTask(model="mlp").build_model()
    full = LocalTrainer(model, ClassificationTask(), "adam", 0.01, None, None)
    x = torch.randn(8, 1, 8, 8)
    y = torch.randint(0, 10, (8,))
    full.compute_gradients((x, y))
    full.apply_update(0.01)  # some optimizer state to cut
    plan = plan_stages(full.model, [], 3)
    stages = [stage_module(full.model, plan, s) for s in range(3)]
    merged = {}
    for s in stages:
        merged |= s.state_dict()
    assert merged.keys() == full.model.state_dict().keys()
    flat = full.flat_optimizer_state()
    parts = [
        flat.slice(plan.offset(s), plan.offset(s) + sum(p.numel() for p in stages[s].parameters())) for s in range(3)
    ]
    again = FlatOptimizerState.concat(parts)
    assert all(torch.equal(again.vectors[k], flat.vectors[k]) for k in flat.vectors)
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sum(sizes) == full.numel and [plan.stage_params(s) for s in range(3)] == sizes


def test_bubble_fraction_and_splitting_a_batch():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    batch = (torch.arange(12).reshape(6, 2), {"y": torch.arange(6)})
    parts = split_batch(batch, 3)
    assert len(parts) == 3 and torch.equal(parts[1][0], torch.tensor([[4, 5], [6, 7]]))
    assert torch.equal(parts[2][1]["y"], torch.tensor([4, 5]))


def test_model_inputs_are_what_the_tasks_forward_passes_to_the_model():
    x, y = torch.randn(3, 1, 8, 8), torch.arange(3)
    args, kwargs = model_inputs(ClassificationTask(), (x, y))
    assert len(args) == 1 and args[0] is x and kwargs == {}


def test_the_timeline_plot_draws_each_stages_spans_and_is_absent_without_them():
    import json

    import pandas as pd

    from distrain.reporting.plots import PlotRun, plot_pipeline_timeline

    # Two stages, M = 2, GPipe: stage 1 starts after stage 0's first forward.
    spans = {
        0: [("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 1, 4.0, 6.0), ("B", 0, 6.0, 8.0)],
        1: [("F", 0, 1.0, 2.0), ("F", 1, 2.0, 3.0), ("B", 1, 3.0, 5.0), ("B", 0, 5.0, 7.0)],
    }
    rows = pd.DataFrame(
        {
            "kind": ["step", "step", "step"],
            "step": [1, 1, 5],
            "stage": [0, 1, 0],
            "replica": [0, 0, 0],
            "wall_time": [1.0, 1.0, 2.0],
            "pipe_spans": [json.dumps([list(s) for s in spans[0]]), json.dumps([list(s) for s in spans[1]]), None],
        }
    )
    run = PlotRun("r", "r", "C0", rows, {})
    fig = plot_pipeline_timeline([run])
    assert fig is not None
    ax = fig.axes[0]
    bars = [c for c in ax.collections]  # one broken_barh per span
    assert len(bars) == 8
    assert [t.get_text() for t in ax.texts][:4] == ["F0", "F1", "B1", "B0"]
    assert plot_pipeline_timeline([PlotRun("r", "r", "C0", rows.drop(columns="pipe_spans"), {})]) is None


def test_a_model_that_cannot_be_cut_is_refused_in_the_pipeline_flag_s_words_by_the_pipeline_strategy():
    """trainers/pipeline_split.py knows no flag (issue 27): its StageCutError carries the detail and the
    pipeline strategy names --pipeline-stages (the message the CLI has always shown)."""
    from distrain.config import RunConfig
    from distrain.strategies.pipeline import plan_stages_for
    from distrain.trainers.pipeline_split import StageCutError

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    with pytest.raises(StageCutError) as raw:
        plan_stages(model, [], 5)
    assert "--pipeline-stages" not in str(raw.value)
    config = RunConfig(pipeline_stages=5, workers=1)
    with pytest.raises(ConfigError, match=r"^--pipeline-stages 5 needs 4 cuts but the model has 2 places to cut"):
        plan_stages_for(model, [], config)
    with pytest.raises(ConfigError, match=r"^--pipeline-stages needs a model that is an nn\.Sequential"):
        plan_stages_for(nn.Linear(2, 2), [], config)
    assert plan_stages_for(model, [], RunConfig(pipeline_stages=2, workers=1)).stages == 2


def test_gpipe_posts_every_receive_of_a_step_before_computing_and_keeps_torch_s_order(monkeypatch):
    """`_preposted_gpipe`: a stage's receives (activations from the stage before, gradients from the one
    after) are all posted when the step starts; computation, sends and waits then go in torch's GPipe
    order (F0..F(M-1), then B0..B(M-1)), each micro-batch after the wait for its own receive."""
    from torch.distributed.pipelining import schedules

    from distrain.strategies.pipeline import _preposted_gpipe

    events: list[tuple] = []

    class Stage:
        def get_fwd_recv_ops(self, i):
            return [("fwd_recv", i)]

        def get_bwd_recv_ops(self, i):
            return [("bwd_recv", i)]

        def get_fwd_send_ops(self, i):
            return [("fwd_send", i)]

        def get_bwd_send_ops(self, i):
            return [("bwd_send", i)]

        def forward_one_chunk(self, i, args, kwargs, save_forward_output=True):
            events.append(("F", i))
            return i

        def backward_one_chunk(self, i, loss=None, last_backward=False):
            events.append(("B", i, last_backward))

        def perform_reduce_grad(self, scale):
            events.append(("reduce", scale))

    class Base:  # the parts of torch's single-stage schedule the subclass calls
        def __init__(self, m):
            self._stage, self._n_microbatches, self.scale_grads = Stage(), m, True

        def _check_inputs(self, arg_mbs, kwarg_mbs, target_mbs, losses):
            return arg_mbs, kwarg_mbs

        def _initialize_stage(self, *args):
            events.append(("init",))

        def _maybe_compute_loss(self, stage, output, target_mbs, i, loss_kwargs):
            pass

        def _maybe_get_loss(self, stage, i):
            return None

        def _update_losses(self, stage, losses):
            pass

    def posted(ops, desc=None):
        events.append(("post", *ops[0]))
        return {0: [ops[0]]}

    monkeypatch.setattr(schedules, "_sorted_batch_p2p", posted)
    monkeypatch.setattr(schedules, "_wait_batch_p2p", lambda work: events.append(("wait", *work[0])))
    m = 3
    _preposted_gpipe(Base)(m)._step_microbatches(arg_mbs=[()] * m, kwarg_mbs=[{}] * m)

    first_compute = events.index(("F", 0))
    assert events[0] == ("init",)
    assert events[1:first_compute] == [
        *[("post", "fwd_recv", i) for i in range(m)],
        *[("post", "bwd_recv", i) for i in range(m)],
        ("wait", "fwd_recv", 0),
    ]
    computed = [e for e in events if e[0] in ("F", "B")]
    assert computed == [*[("F", i) for i in range(m)], *[("B", i, i == m - 1) for i in range(m)]]
    for kind, recv in (("F", "fwd_recv"), ("B", "bwd_recv")):
        for i in range(m):
            at = next(k for k, e in enumerate(events) if e[:2] == (kind, i))
            assert events[at - 1] == ("wait", recv, i)  # its own receive, waited just before
            assert events.index(("post", recv, i)) < first_compute
    sends = [e for e in events if e[0] == "post" and e[1].endswith("send")]
    assert sends == [*[("post", "fwd_send", i) for i in range(m)], *[("post", "bwd_send", i) for i in range(m)]]
    assert events[-1] == ("reduce", m)


def test_run_delay_is_this_thread_s_wait_for_a_core_or_none_where_linux_does_not_say(monkeypatch):
    from distrain.strategies import pipeline

    first = pipeline.run_delay_s()
    if first is not None:  # Linux: non-decreasing seconds
        sum(i * i for i in range(200_000))
        assert 0.0 <= first <= pipeline.run_delay_s()

    def missing(*args, **kwargs):
        raise FileNotFoundError("/proc/thread-self/schedstat")

    monkeypatch.setattr("builtins.open", missing)
    assert pipeline.run_delay_s() is None
