"""Optimizers and their state in a *flat* form that any transport can hold.

A torch optimizer keeps state per parameter tensor. Because a replica's parameters are views into one
flat buffer (see `local_trainer`), the same state can be written as one flat vector per state key
(`momentum_buffer`, `sum`, `exp_avg`, ...) plus scalars (`step`). That form slices cleanly into
parameter-server shards and concatenates back, so a checkpoint taken under one transport restores
under another: all-reduce replicas and PS shards run the very same torch optimizer code.

That only holds for *element-wise* optimizers: those whose update of one parameter value reads only
that value's gradient and state (plus scalars every tensor shares, like the step count). A PS shard's
slice cuts across tensors, so an optimizer that looks at a whole tensor (Adafactor's row and column
factors, Muon's orthogonalised matrices), at all parameters at once (LBFGS's line search), or at
sparse gradients (SparseAdam) would compute something else there; those are refused by name.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distrain.errors import ConfigError

# distrain's name (lower case) -> torch.optim class name: the element-wise optimizers.
OPTIMIZERS = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "adamax": "Adamax",
    "nadam": "NAdam",
    "radam": "RAdam",
    "adadelta": "Adadelta",
    "asgd": "ASGD",
    "rprop": "Rprop",
}
# torch.optim optimizers that are not element-wise, and why they cannot run here.
_WHOLE = (
    "so it needs whole tensors, and --fsdp shards, parameter-server shards and flat optimizer state cut across them"
)
REFUSED = {
    "lbfgs": "it needs a closure that re-evaluates the loss, for a line search over all parameters at once",
    "sparseadam": "it needs sparse gradients, and distrain's gradients are one dense flat buffer",
    "adafactor": f"it factors second moments over each matrix's rows and columns, {_WHOLE}",
    "muon": f"it orthogonalises each whole weight matrix, {_WHOLE}",
}
DEFAULT_SGD_MOMENTUM = 0.9  # distrain's default for sgd when --momentum is not given (torch's is 0)
# Constructor arguments set by distrain's own flags, or meaningless when distrain runs the optimizer.
RESERVED_ARGS = {
    "lr": "the rate comes from --lr, --lr-scaling, --warmup-epochs and --lr-decay",
    "momentum": "use --momentum",
    "weight_decay": "use --weight-decay",
    "differentiable": "distrain does not differentiate through the optimizer step",
    "capturable": "distrain does not capture optimizer steps in CUDA graphs",
}
# State entries that are one number per optimizer, not one per parameter value (equal for every
# tensor of a replica, since every tensor steps every time with the same hyperparameters).
SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


def _torch_optimizers() -> set[str]:
    """Lower-case names of every optimizer class torch.optim has."""
    return {
        n.lower()
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    return getattr(torch.optim, OPTIMIZERS[name])


def _takes(cls: type[torch.optim.Optimizer]) -> list[str]:
    """The constructor's keyword arguments, other than the parameters themselves."""
    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")]


def takes_argument(name: str, argument: str) -> bool:
    return argument in _takes(optimizer_class(name))


def _torch_value(value: Any) -> Any:
    """A YAML value as torch expects it: lists become tuples (betas, etas), numeric text a float
    (YAML 1.1 reads `1e-8` as a string)."""
    if isinstance(value, list):
        return tuple(_torch_value(v) for v in value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _constructor_kwargs(
    name: str, momentum: float | None, weight_decay: float | None, args: dict[str, Any] | None
) -> dict[str, Any]:
    kwargs = {k: _torch_value(v) for k, v in (args or {}).items()}
    if momentum is None and name == "sgd":
        momentum = DEFAULT_SGD_MOMENTUM
    if momentum is not None:
        kwargs["momentum"] = momentum
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    return kwargs


def make_optimizer(
    name: str,
    params: list[nn.Parameter],
    lr: float,
    momentum: float | None = None,
    weight_decay: float | None = None,
    args: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """`name`'s torch optimizer over `params`. None for `momentum` or `weight_decay` means the
    optimizer's own default (sgd: momentum 0.9, distrain's default); `args` are further constructor
    arguments (checked beforehand by `check_optimizer`)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}")
    return optimizer_class(name)(params, lr=lr, **_constructor_kwargs(name, momentum, weight_decay, args))


def check_optimizer(name: str, args: dict[str, Any], momentum: float | None, weight_decay: float | None) -> str:
    """Validate an optimizer choice up front; returns its canonical (lower-case) name. Each problem is one
    ConfigError line naming the flag and the fix."""
    key = name.lower()
    valid = ", ".join(OPTIMIZERS)
    if key in REFUSED or (key not in OPTIMIZERS and key in _torch_optimizers()):
        reason = REFUSED.get(key, "it is not known to update each parameter value on its own, as flat slices need")
        raise ConfigError(f"--optimizer {name} is not supported: {reason}; choose an element-wise one: {valid}")
    if key not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {name!r}; choose one of: {valid}")
    takes = _takes(optimizer_class(key))
    for arg in args:
        if arg in RESERVED_ARGS:
            raise ConfigError(f"--optimizer-arg {arg} is not accepted: {RESERVED_ARGS[arg]}")
        if arg not in takes:
            accepted = ", ".join(a for a in takes if a not in RESERVED_ARGS)
            raise ConfigError(f"--optimizer {key} takes no argument {arg!r}; it takes: {accepted}")
    for flag, value, arg in (("--momentum", momentum, "momentum"), ("--weight-decay", weight_decay, "weight_decay")):
        if value is not None and arg not in takes:
            users = ", ".join(n for n in OPTIMIZERS if takes_argument(n, arg))
            raise ConfigError(f"{flag} is not used by --optimizer {key}; drop it (it applies to: {users})")
    try:  # the constructor checks values (ranges, combinations such as nesterov without momentum)
        make_optimizer(key, [nn.Parameter(torch.zeros(1))], 0.0, momentum, weight_decay, args)
    except (ValueError, TypeError, RuntimeError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        given = " ".join(f"{k}={v}" for k, v in args.items())
        raise ConfigError(f"--optimizer {key} refuses its arguments ({given or 'defaults'}): {detail}") from None
    return key


@dataclass
class FlatOptimizerState:
    vectors: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> flat tensor over all params
    scalars: dict[str, float] = field(default_factory=dict)  # e.g. Adam's "step", NAdam's "mu_product"

    def slice(self, start: int, stop: int) -> FlatOptimizerState:
        return FlatOptimizerState({k: v[start:stop].clone() for k, v in self.vectors.items()}, dict(self.scalars))

    @classmethod
    def concat(cls, parts: list[FlatOptimizerState]) -> FlatOptimizerState:
        if not parts or not parts[0].vectors:
            return FlatOptimizerState({}, dict(parts[0].scalars) if parts else {})
        keys = parts[0].vectors.keys()
        return cls({k: torch.cat([p.vectors[k] for p in parts]) for k in keys}, dict(parts[0].scalars))

    def to_dict(self) -> dict:
        return {"vectors": self.vectors, "scalars": self.scalars}

    @classmethod
    def from_dict(cls, data: dict) -> FlatOptimizerState:
        return cls(dict(data["vectors"]), dict(data["scalars"]))


def _is_vector(key: str, states: list[dict], params: list[nn.Parameter]) -> bool:
    """Whether state `key` holds one value per parameter value (else it is one shared number). Decided
    over every tensor, and by name for the known scalars: a 0-d parameter's vector looks like a scalar."""
    if key in SCALAR_STATE:
        return False
    return all(torch.is_tensor(s[key]) and s[key].shape == p.shape for s, p in zip(states, params, strict=True))


def export_flat_state(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], whole: Any = None
) -> FlatOptimizerState:
    """The optimizer's state over `params` in flat form. `whole` makes each state tensor whole first (a
    sharded replica's: every shard's pieces gathered, trainers/sharded_trainer.py)."""
    states = [optimizer.state.get(p, {}) for p in params]
    if whole is not None:
        states = [{k: whole(v) if torch.is_tensor(v) else v for k, v in s.items()} for s in states]
    if not any(states):
        return FlatOptimizerState()
    vectors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    for key, value in states[0].items():
        if value is None:  # e.g. SGD's momentum_buffer before its first use, in some torch versions
            continue
        if _is_vector(key, states, params):
            vectors[key] = torch.cat([s[key].detach().reshape(-1).cpu() for s in states])
        elif not torch.is_tensor(value) or value.numel() == 1:
            scalars[key] = float(value)
        else:
            raise ValueError(f"optimizer state {key!r} is neither one value per parameter nor one number")
    return FlatOptimizerState(vectors, scalars)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors this process holds: a DTensor's (a sharded replica's) local
    part, every other tensor whole, scalars such as Adam's step included."""
    from torch.distributed.tensor import DTensor

    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def scalar_placement(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict[str, Any]:
    """Where torch itself keeps a scalar state entry: on the parameter's device for fused steps and for
    ASGD (whose eta and mu live there), else on the CPU; float64 only under a float64 default dtype."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    on_device = isinstance(optimizer, torch.optim.ASGD) or any(
        g.get("fused") or g.get("capturable") for g in optimizer.param_groups
    )
    return {"dtype": dtype, "device": p.device if on_device else torch.device("cpu")}


def import_flat_state(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], flat: FlatOptimizerState, place: Any = None
) -> None:
    """Replace the optimizer's per-parameter state with `flat` (which must cover exactly `params`).
    `place(whole, p)` makes parameter `p`'s state tensor from its whole value (a sharded replica keeps
    its own shard, trainers/sharded_trainer.py); by default a copy on `p`'s device and dtype."""
    optimizer.state.clear()
    if not flat.vectors and not flat.scalars:
        return
    total = sum(p.numel() for p in params)
    for key, vec in flat.vectors.items():
        if vec.numel() != total:
            raise ValueError(f"optimizer state {key!r} has {vec.numel()} values for {total} parameters")
    offset = 0
    for p in params:
        n = p.numel()
        state: dict = {}
        for key, vec in flat.vectors.items():
            whole = vec[offset : offset + n].view(p.shape)
            state[key] = place(whole, p) if place is not None else whole.to(device=p.device, dtype=p.dtype).clone()
        for key, value in flat.scalars.items():
            state[key] = torch.tensor(value, **scalar_placement(optimizer, p))
        optimizer.state[p] = state
        offset += n


def state_fits(
    name: str,
    momentum: float | None,
    weight_decay: float | None,
    args: dict[str, Any] | None,
    flat: FlatOptimizerState,
) -> bool:
    """Whether `flat` holds every state entry `name` (so configured) steps with: a checkpoint of
    another optimizer, or of Adam without amsgrad for Adam with it, does not. Found by one zero-gradient
    step of the optimizer on a one-value parameter, which makes it create its state."""
    p = nn.Parameter(torch.zeros(1))
    optimizer = make_optimizer(name, [p], 0.0, momentum, weight_decay, args)
    p.grad = torch.zeros(1)
    optimizer.step()
    return set(optimizer.state[p]) <= set(flat.vectors) | set(flat.scalars)
