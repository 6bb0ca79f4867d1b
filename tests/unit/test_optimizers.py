"""Every element-wise optimizer on flat slices (no Ray): what the PS shards and checkpoints rely on.

A replica steps its optimizer over the model's tensors; K parameter-server shards each step the same
optimizer over one flat slice that cuts across those tensors; a checkpoint stores the state flat.
For an element-wise optimizer all three must be the same computation, value for value.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from distrain.config import RunConfig, parse_optimizer_args
from distrain.errors import ConfigError
from distrain.trainers.optim_state import (
    OPTIMIZERS,
    FlatOptimizerState,
    check_optimizer,
    export_flat_state,
    import_flat_state,
    make_optimizer,
    state_fits,
)

SHAPES = [(3, 4), (5,), (2, 3), (1,)]  # 24 values; the shard cut (at 10) falls inside the first tensor
CUT = 10
STEPS = 12
# (name, --momentum, --weight-decay, --optimizer-arg): every optimizer, and the variants that add state
CASES = [
    ("sgd", None, 1e-3, {}),
    ("sgd", 0.9, None, {"nesterov": True}),
    ("adam", None, 1e-2, {}),
    ("adam", None, None, {"amsgrad": True, "betas": [0.8, 0.95]}),
    ("adamw", None, None, {}),
    ("adamw", None, 0.1, {"fused": True}),  # fused kernels keep their step on the parameter's device
    ("adagrad", None, 1e-3, {"lr_decay": 0.01}),
    ("rmsprop", 0.5, None, {"centered": True}),
    ("rmsprop", None, None, {}),
    ("adamax", None, 1e-3, {}),
    ("nadam", None, None, {"decoupled_weight_decay": True}),
    ("radam", None, 1e-2, {}),
    ("adadelta", None, None, {"rho": 0.8}),
    ("asgd", None, 1e-3, {"t0": 3}),
    ("rprop", None, None, {"etas": [0.4, 1.3]}),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def grads(step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, generator=g)


def rate(step: int) -> float:
    return 0.05 * (1 + step) / STEPS  # a changing rate, as warmup and decay set it each step


class Replica:
    """Parameters as views into one flat buffer, as LocalTrainer holds them."""

    def __init__(self, case, theta: torch.Tensor) -> None:
        name, momentum, wd, args = case
        self.flat = theta.clone()
        self.params = []
        offset = 0
        for shape in SHAPES:
            n = torch.Size(shape).numel()
            p = nn.Parameter(self.flat[offset : offset + n].view(shape))
            self.params.append(p)
            offset += n
        self.opt = make_optimizer(name, self.params, 0.0, momentum, wd, args)

    def step(self, step: int) -> None:
        g = grads(step, self.flat.numel())
        offset = 0
        for p in self.params:
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        for group in self.opt.param_groups:
            group["lr"] = rate(step)
        self.opt.step()

    def theta(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])


class Shard:
    """One flat slice as its own parameter, as ParameterShard holds it."""

    def __init__(self, case, theta: torch.Tensor, start: int, stop: int) -> None:
        name, momentum, wd, args = case
        self.start, self.stop = start, stop
        self.param = nn.Parameter(theta[start:stop].clone())
        self.opt = make_optimizer(name, [self.param], 0.0, momentum, wd, args)

    def step(self, step: int) -> None:
        self.param.grad = grads(step, 24)[self.start : self.stop].clone()
        for group in self.opt.param_groups:
            group["lr"] = rate(step)
        self.opt.step()


def initial_theta() -> torch.Tensor:
    return torch.randn(24, generator=torch.Generator().manual_seed(0))


def test_cases_cover_every_supported_optimizer():
    assert {c[0] for c in CASES} == set(OPTIMIZERS)


def comparison(case):
    """Exact equality; for fused kernels, whose vector lanes fall at other offsets on a slice and so may
    round a value differently (one ulp), equality to a float32 rounding."""
    if case[3].get("fused"):
        return lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0)
    return torch.equal


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shards_on_flat_slices_equal_one_replica(case):
    theta = initial_theta()
    replica = Replica(case, theta)
    shards = [Shard(case, theta, 0, CUT), Shard(case, theta, CUT, 24)]
    for step in range(STEPS):
        replica.step(step)
        for s in shards:
            s.step(step)
    sharded = torch.cat([s.param.detach() for s in shards])
    assert not torch.equal(replica.theta(), theta)  # it moved
    same = comparison(case)
    assert same(replica.theta(), sharded)
    # ... and the state is the same flat state, however it was cut
    whole = export_flat_state(replica.opt, replica.params)
    parts = FlatOptimizerState.concat([export_flat_state(s.opt, [s.param]) for s in shards])
    assert whole.vectors.keys() == parts.vectors.keys() and whole.scalars == parts.scalars
    for key in whole.vectors:
        assert same(whole.vectors[key], parts.vectors[key]), key


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_flat_state_round_trip_through_a_checkpoint_continues_identically(case):
    """Half the steps on a replica, its flat state saved as a checkpoint stores it (torch.save, loaded
    weights_only), restored onto two shards (a transport switch), the rest there: the same as never
    stopping. Every state entry must cross: Rprop's prev and step_size, ASGD's eta, mu and ax,
    NAdam's mu_product, Adam's max_exp_avg_sq, ..."""
    theta = initial_theta()
    straight = Replica(case, theta)
    for step in range(STEPS):
        straight.step(step)

    first = Replica(case, theta)
    for step in range(STEPS // 2):
        first.step(step)
    buffer = io.BytesIO()
    torch.save({"theta": first.theta(), "optimizer": export_flat_state(first.opt, first.params).to_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    flat = FlatOptimizerState.from_dict(saved["optimizer"])
    assert flat.vectors or flat.scalars

    shards = [Shard(case, saved["theta"], 0, CUT), Shard(case, saved["theta"], CUT, 24)]
    for s in shards:
        import_flat_state(s.opt, [s.param], flat.slice(s.start, s.stop))
    for step in range(STEPS // 2, STEPS):
        for s in shards:
            s.step(step)
    same = comparison(case)
    assert same(straight.theta(), torch.cat([s.param.detach() for s in shards]))

    # and back from the shards onto a replica (a PS checkpoint resumed under all-reduce)
    back = Replica(case, torch.cat([s.param.detach() for s in shards]))
    import_flat_state(
        back.opt, back.params, FlatOptimizerState.concat([export_flat_state(s.opt, [s.param]) for s in shards])
    )
    straight.step(STEPS)
    back.step(STEPS)
    assert same(straight.theta(), back.theta())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_replica_stepping_its_flat_buffer_equals_a_per_tensor_torch_optimizer(case):
    """LocalTrainer steps one flat tensor (all parameters at once); a plain torch loop steps the model's
    tensors one by one. Same gradients, same rates: the same parameters, value for value."""
    from distrain.trainers.local_trainer import LocalTrainer

    name, momentum, wd, args = case
    build = lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))  # noqa: E731 - 4 tensors, 26 values
    torch.manual_seed(0)
    trainer = LocalTrainer(build(), None, name, 0.0, momentum, wd, "cpu", args)
    torch.manual_seed(0)
    plain = build()
    reference = make_optimizer(name, list(plain.parameters()), 0.0, momentum, wd, args)
    for step in range(STEPS):
        g = grads(step, trainer.numel)
        trainer.grads_flat.copy_(g)
        trainer.apply_update(rate(step))
        offset = 0
        for p in plain.parameters():
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        for group in reference.param_groups:
            group["lr"] = rate(step)
        reference.step()
    flat_plain = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    torch.manual_seed(0)
    start = torch.cat([p.detach().reshape(-1) for p in build().parameters()])
    assert not torch.allclose(trainer.params_flat, start)  # it moved
    assert comparison(case)(trainer.params_flat, flat_plain)
    assert comparison(case)(torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]), flat_plain)
    mine, theirs = trainer.flat_optimizer_state(), export_flat_state(reference, list(plain.parameters()))
    assert mine.vectors.keys() == theirs.vectors.keys() and mine.scalars == theirs.scalars


def test_scalar_parameter_keeps_its_state_per_value():
    """A 0-d parameter's state looks like a scalar; it is still one value per parameter value."""
    params = [nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.ones(3))]
    opt = make_optimizer("adam", params, 0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    flat = export_flat_state(opt, params)
    assert flat.vectors["exp_avg"].numel() == 4 and set(flat.scalars) == {"step"}


def test_sgd_default_momentum_and_explicit_choices():
    p = [nn.Parameter(torch.zeros(2))]
    assert make_optimizer("sgd", p, 0.1).param_groups[0]["momentum"] == 0.9  # distrain's sgd default
    assert make_optimizer("sgd", p, 0.1, momentum=0.0).param_groups[0]["momentum"] == 0.0
    assert make_optimizer("rmsprop", p, 0.1).param_groups[0]["momentum"] == 0  # torch's own default
    assert make_optimizer("adamw", p, 0.1).param_groups[0]["weight_decay"] == 0.01  # torch's own default
    assert make_optimizer("adamw", p, 0.1, weight_decay=0.0).param_groups[0]["weight_decay"] == 0.0
    group = make_optimizer("adam", p, 0.1, args={"betas": [0.8, 0.9], "eps": "1e-6"}).param_groups[0]
    assert group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6  # YAML list and YAML-1.1 number text


def test_state_fits_knows_what_each_optimizer_steps_with():
    def state_of(name, **args):
        p = nn.Parameter(torch.zeros(3))
        opt = make_optimizer(name, [p], 0.1, args=args)
        p.grad = torch.ones(3)
        opt.step()
        return export_flat_state(opt, [p])

    adam = state_of("adam")
    assert state_fits("adam", None, None, {}, adam)
    assert state_fits("adamw", None, None, {}, adam)  # the same moments
    assert not state_fits("adam", None, None, {"amsgrad": True}, adam)  # max_exp_avg_sq missing
    assert not state_fits("rprop", None, None, {}, adam)
    assert not state_fits("sgd", None, None, {}, FlatOptimizerState())  # momentum buffers missing
    assert state_fits("sgd", 0.0, None, {}, FlatOptimizerState())  # plain SGD keeps no state


# ---------------------------------------------------------------- validation, up front, in one line
def test_names_are_case_insensitive_and_canonical():
    assert RunConfig(optimizer="AdamW").optimizer == "adamw"
    assert RunConfig(optimizer="RMSprop", momentum=0.5).optimizer == "rmsprop"
    assert check_optimizer("NAdam", {}, None, None) == "nadam"


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"optimizer": "lion"}, r"^unknown --optimizer 'lion'; choose one of: sgd, adam, adamw, .*rprop$"),
        ({"optimizer": "LBFGS"}, r"^--optimizer LBFGS is not supported: it needs a closure .*choose an element-wise"),
        ({"optimizer": "sparseadam"}, r"is not supported: it needs sparse gradients"),
        ({"optimizer": "adafactor"}, r"is not supported: .*rows and columns, so it needs whole tensors"),
        (
            {"optimizer": "adam", "momentum": 0.5},
            r"^--momentum is not used by --optimizer adam; drop it .*sgd, rmsprop",
        ),
        ({"optimizer": "rprop", "weight_decay": 0.1}, r"^--weight-decay is not used by --optimizer rprop"),
        ({"optimizer_args": {"bogus": 1}}, r"^--optimizer sgd takes no argument 'bogus'; it takes: .*nesterov"),
        ({"optimizer": "adam", "optimizer_args": {"lr": 0.1}}, r"^--optimizer-arg lr is not accepted: .*--lr"),
        ({"optimizer_args": {"momentum": 0.1}}, r"^--optimizer-arg momentum is not accepted: use --momentum"),
        ({"optimizer_args": {"differentiable": True}}, r"^--optimizer-arg differentiable is not accepted"),
        ({"optimizer": "adam", "optimizer_args": {"betas": [1.5, 0.9]}}, r"refuses its arguments .*beta"),
        ({"optimizer_args": {"nesterov": True}, "momentum": 0.0}, r"refuses its arguments .*Nesterov"),
        ({"optimizer_args": ["nesterov"]}, r"^--optimizer-arg must be a mapping"),
    ],
)
def test_bad_optimizer_choices_are_refused_in_one_line(kw, pattern):
    with pytest.raises(ConfigError, match=pattern) as info:
        RunConfig(**kw)
    assert "\n" not in str(info.value)


def test_optimizer_arg_flags_parse_as_yaml():
    assert parse_optimizer_args(["betas=[0.9, 0.95]", "amsgrad=true", "eps=1e-8", "t0=3"]) == {
        "betas": [0.9, 0.95],
        "amsgrad": True,
        "eps": "1e-8",  # YAML 1.1 text; the optimizer receives the float
        "t0": 3,
    }
    for bad in ["nesterov", "=1", "a b=1", "x=", "x=[1"]:
        with pytest.raises(ConfigError, match="must be KEY=VALUE"):
            parse_optimizer_args([bad])


def test_a_new_optimizer_flag_drops_the_files_momentum_and_arguments(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: sgd\nmomentum: 0.5\noptimizer_args: {nesterov: true}\n")
    cfg = RunConfig.resolve(str(path), {"optimizer": "adam"})
    assert (cfg.optimizer, cfg.momentum, cfg.optimizer_args) == ("adam", None, {})
    same = RunConfig.resolve(str(path), {"optimizer_args": {"dampening": 0.0}})
    assert same.optimizer_args == {"nesterov": True, "dampening": 0.0} and same.momentum == 0.5
    # the written config.yaml repeats the run
    again = RunConfig.from_mapping(__import__("yaml").safe_load(same.to_yaml()))
    assert again == same


def test_a_new_lr_decay_flag_drops_the_files_decay_settings(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(RunConfig(lr_decay="cosine", lr_min=0.01).to_yaml())
    cfg = RunConfig.resolve(str(path), {"lr_decay": "step", "lr_decay_epochs": 2.0})
    assert (cfg.lr_decay, cfg.lr_min, cfg.lr_decay_epochs, cfg.lr_decay_gamma) == ("step", None, 2.0, None)
    assert RunConfig.resolve(str(path), {}).lr_min == 0.01
