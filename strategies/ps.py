"""Parameter-server strategies, worker side: async (Downpour) and SSP; BSP over PS lives in bsp.py.

The worker side is the same for every rule: push the gradient, pull θ (one combined call per shard,
see `PSClient`), count the clock. What differs is the rule the shards enforce (`ps_rule`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.errors import ConfigError
from distrain.fields import setting
from distrain.strategies.base import CommStats, PlanningSetting, Strategy, StrategyContext, StrategyOptions
from distrain.strategies.consistency import ConsistencyRule, refuse_matrix_codec
from distrain.strategies.strategy_names import STRATEGIES

if TYPE_CHECKING:
    import numpy as np
    import torch

    from distrain.compression import CodecSpec
    from distrain.config import RunConfig
    from distrain.strategies.ps_client import PSClient, PushPullResult
    from distrain.trainers.local_trainer import LocalTrainer


class HostStaging:
    """The host buffers a worker exchanges θ and gradients with the shards through (numpy, Ray's object
    store). On the CPU they are the trainer's own flat tensors (no copy). On a CUDA device they are pinned
    host copies (`trainers/task.py` `pins_memory`), so both copies are DMA transfers: the gradient's to the
    host waits for the device (its bytes are read at once), θ's to the device is asynchronous, and the next
    write into the θ buffer first waits for it to finish."""

    def __init__(self, trainer: LocalTrainer) -> None:
        import torch

        from distrain.trainers.task import pins_memory

        self.trainer = trainer
        self.pinned = pins_memory(trainer.params_flat.device)
        self.params: torch.Tensor | None = None  # None: the trainer's own (on the CPU)
        self.grads: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # θ's last copy to the device
        if self.pinned:
            p, g = trainer.params_flat, trainer.grads_flat
            self.params = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            self.grads = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)

    def params_out(self) -> np.ndarray:
        """The host buffer to write the shards' θ into (then `install` it)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return (self.trainer.params_flat if self.params is None else self.params).numpy()

    def install(self) -> None:
        """θ, as written into `params_out()`, into the trainer's parameters."""
        if self.params is not None:
            import torch

            self.trainer.params_flat.copy_(self.params, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def grads_in(self) -> torch.Tensor:
        """The trainer's gradient on the host (a CPU tensor), to push."""
        if self.grads is None:
            return self.trainer.grads_flat
        import torch

        self.grads.copy_(self.trainer.grads_flat, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # its bytes are read right away (serialised, encoded)
        return self.grads


class PSStrategy(Strategy):
    transports = ("ps",)
    compresses = "gradient pushes, the residual kept on the worker (pulls stay float32)"

    def __init__(self, config: RunConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.clock = 0  # iterations this worker has pushed
        self.rounds = self.ps_rule(config).mode == "rounds"  # only rounds drop gradients (k-of-n)
        self._staging: HostStaging | None = None

    @property
    def client(self) -> PSClient:
        """The channel's client of the shards (versions read, waits for a round, snapshots)."""
        return self.channel.ps

    @classmethod
    def check_codec(cls, config: RunConfig, codec: CodecSpec) -> None:
        super().check_codec(config, codec)
        refuse_matrix_codec(codec)

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        raise NotImplementedError

    def staging(self, trainer: LocalTrainer) -> HostStaging:
        """`trainer`'s host buffers for the shards' traffic (pinned on CUDA), made on first use."""
        if self._staging is None or self._staging.trainer is not trainer:
            self._staging = HostStaging(trainer)
        return self._staging

    def setup(self, trainer: LocalTrainer) -> None:
        # The shards hold this worker's clock: a worker started after a restore continues from it.
        host = self.staging(trainer)
        self.clock = self.channel.pull(host.params_out())
        host.install()

    def step(self, trainer: LocalTrainer, lr: float) -> CommStats:
        # A non-finite gradient never reaches the shards. Skipped, the push still carries the clock
        # (None for the gradient): the worker takes part in its round, contributing nothing.
        ok = self.usable_gradient(trainer, "loss or gradient", check_loss=True)
        if ok:  # --clip-grad-norm: each push's own gradient (a shard sees only its slice of the norm)
            trainer.clip_gradient_()
        host = self.staging(trainer)
        grads = host.grads_in() if ok else None
        result, traffic = self.channel.push_pull("grads", self.clock, grads, lr, host.params_out())
        host.install()
        self._advance(result)
        return CommStats(
            wait_s=result.wait_s,
            read_version=result.read_version,
            applied_version=result.applied_version,
            lag=result.lag,
            clock=result.clock,
            min_clock=result.min_clock,
            dropped=result.dropped if self.rounds else None,
            nonfinite=None if ok else True,
        ).add(traffic)

    def _advance(self, result: PushPullResult) -> None:
        self.clock += 1

    def prepare_eval(self, trainer: LocalTrainer) -> None:
        host = self.staging(trainer)
        self.client.pull(host.params_out())
        host.install()

    def export_state(self, trainer: LocalTrainer) -> dict[str, Any]:
        """The shards' snapshot: θ (installed in the replica, so the model state dict carries it)
        and the optimizer state, slice by slice, assembled into flat form."""
        import torch

        theta, optimizer, counters = self.client.snapshot()
        trainer.params_flat.copy_(torch.from_numpy(theta))
        return {"model": trainer.model_state(), "optimizer": optimizer.to_dict(), "ps": counters}


# The staleness-aware rate (Zhang et al. 2016) is on unless --no-staleness-lr: N workers pushing on
# arrival already add an implicit momentum of about 1 - 1/N (Mitliagkas et al. 2016, "Asynchrony begets
# momentum"), and sgd's default momentum 0.9 on top of it oscillates: a well-conditioned regression
# ended at MSE 0.24-9.7 under ssp and 1.0-19 under async (3 workers, noise floor 0.01), 0.011-0.013 with
# it, within a point of the old accuracy on the digits. Dividing by the staleness shrinks the steps made on
# old parameters, works for every optimizer, and leaves --momentum as given (docs/strategies.md, "Asynchronous
# defaults", has the measurements and the momentum rule it was chosen over).
STALENESS_LR_HELP = (
    "Divide a gradient's rate by its staleness tau when tau > 1 (Zhang et al. 2016: steps made on old "
    "parameters are damped); default on (async, ssp; ssp --staleness 0 is BSP and applies none); "
    "--no-staleness-lr turns it off."
)
DEFAULT_STALENESS = 2
DEFAULT_STALENESS_LR = True


@dataclass(frozen=True)
class AsyncOptions(StrategyOptions):
    staleness_lr: bool | None = setting(None, STALENESS_LR_HELP, "strategy")

    def resolved(self, run: RunConfig) -> AsyncOptions:
        return dataclasses.replace(self, staleness_lr=DEFAULT_STALENESS_LR) if self.staleness_lr is None else self


class OnArrival(PSStrategy):
    """async and ssp: the shards apply each gradient as it arrives (the bounded rule)."""

    described_options = ("staleness_lr",)

    @classmethod
    def run_settings_text(cls, config: dict[str, Any]) -> str:
        return " staleness-lr" if config.get("staleness_lr") else ""

    @classmethod
    def implementation(cls, config: RunConfig) -> type[Strategy]:
        if config.sharded and cls.name in ("async", "ssp"):  # --fsdp D, --tensor-parallel T: to PS shard d, t
            from distrain.strategies.sharded_ps import ShardedAsync, ShardedSSP

            return ShardedAsync if cls.name == "async" else ShardedSSP
        return cls

    @classmethod
    def actor_figures(cls, config: RunConfig, actors: dict[str, Any]) -> dict[str, Any]:
        # What the shards' rule did, for summary.json (config.yaml holds the option; ssp --staleness 0 applies none).
        return {"staleness_lr": cls.ps_rule(config).staleness_lr}


@STRATEGIES.register("async", "Downpour async SGD on the parameter server: apply each gradient on arrival")
class AsyncSGD(OnArrival):
    name = "async"
    Options = AsyncOptions
    independent_workers = True
    # Units go to whoever is free and the shards hold θ, the optimizer and the clocks (the bound is
    # infinite: nobody waits on an absent rank's clock), so workers may come and go.
    elastic = True

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        return ConsistencyRule.asynchronous(config.options_of(cls.name).staleness_lr)


@dataclass(frozen=True)
class SSPOptions(StrategyOptions):
    staleness: int | None = setting(
        None, "SSP staleness bound s: no worker runs more than s clocks ahead; default 2 (ssp).", "strategy"
    )
    staleness_lr: bool | None = setting(None, STALENESS_LR_HELP, "strategy")

    def resolved(self, run: RunConfig) -> SSPOptions:
        return dataclasses.replace(
            self,
            staleness=DEFAULT_STALENESS if self.staleness is None else self.staleness,
            staleness_lr=DEFAULT_STALENESS_LR if self.staleness_lr is None else self.staleness_lr,
        )

    def check(self, run: RunConfig) -> None:
        if self.staleness is not None and self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")


@STRATEGIES.register("ssp", "stale synchronous parallel: async, but no worker runs > --staleness clocks ahead")
class SSP(OnArrival):
    name = "ssp"
    Options = SSPOptions
    described_options = ("staleness", "staleness_lr")
    planning = (PlanningSetting("staleness", "bound", DEFAULT_STALENESS),)
    sweep_flags = {"staleness": "SSP staleness bounds, e.g. 0,2,8 (needs an ssp strategy)."}
    # Under --workers MIN..MAX the units are shared (whoever asks; a slot may be empty) and the shards
    # measure the bound among the members' clocks (`ParameterShard.set_members`).
    elastic = True

    @classmethod
    def ps_rule(cls, config: RunConfig) -> ConsistencyRule:
        options = config.options_of(cls.name)
        return ConsistencyRule.ssp(options.staleness, options.staleness_lr)

    @classmethod
    def settings_text(cls, config: dict[str, Any]) -> str:
        return f" s={config['staleness']}" if config.get("staleness") is not None else ""

    @classmethod
    def run_settings_text(cls, config: dict[str, Any]) -> str:
        # SSP(0) is BSP: it divides by no staleness, whatever the option says
        return super().run_settings_text(config) if config.get("staleness") != 0 else ""
