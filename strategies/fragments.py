"""Streaming DiLoCo's fragments and rounds (Douillard et al. 2025), shared by DiLoCo over plain replicas
(strategies/diloco.py) and across cut replicas (strategies/sharded_diloco.py), which says what the
fragments mean and how they are configured (`--fragments`, `--overlap-steps`, `--mix-alpha`).

A fragment is a set of whole tensors, cut by the whole tensors' sizes (`fragment_spans`), so it is the
same on every worker, whether a replica is one worker or cut over several (each of which holds its part of
every tensor). No torch at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrain.strategies.base import CommStats, StrategyContext
from distrain.trainers.shares import ShareTally

if TYPE_CHECKING:
    import torch

    from distrain.strategies.channel import Pending
    from distrain.strategies.diloco import DiLoCoOptions


class FragmentRounds:
    """Streaming DiLoCo's rounds, the same for a plain replica (DiLoCo) and a cut one (ShardedDiLoCo,
    strategies/sharded_diloco.py): the fragments and their staggered schedule (fragment p at the inner
    steps t with t mod H = p·H/P), each fragment's all-reduce launched in the background and completed
    `--overlap-steps` τ later, its outer step and the mix θ_i ← α·θ_i + (1 − α)·θ_g, and the close of a
    period. One fragment, τ = 0, α = 0 is DiLoCo's one outer step every H inner steps.

    What a replica's θ is made of is the class's own: `pseudo_gradient` (this worker's values of θ_g − θ_i
    over the fragment, flat), `agreed_finite` (whether every worker may step on the mean), `outer_step`
    and `mix`. A plain replica holds the fragment whole; a cut replica's worker holds its part (FSDP
    shard, tensor-parallel slice) of each of the fragment's tensors and averages it with the workers
    holding that part in the other replicas (the stream's group)."""

    # Given by the strategy class it is mixed into (annotations only: nothing here shadows them).
    options: DiLoCoOptions
    channel: Any
    ctx: StrategyContext
    finite: Any  # Strategy.finite: the run's --on-nonfinite decision
    slices_per_step: int  # the equal parts of a step's samples (a plain replica's: one a worker)

    def start_rounds(self) -> None:
        self.fragments: list[Fragment] = []  # θ_g fragment by fragment (one fragment: DiLoCo itself)
        self.t = 0  # inner steps since the period began (fragment p syncs when t % H == its offset)
        self.outer_steps = 0  # fragment outer steps completed (one fragment: DiLoCo's outer steps)
        self.tallies: list[ShareTally] = []  # heterogeneous shares: samples per fragment since its last sync

    def after_inner_step(self, trainer: Any, stats: CommStats) -> CommStats:
        """The schedule after an inner step: fragments due arrive, fragments at their offset are launched."""
        self.t += 1
        h, overlap = self.options.sync_every, self.options.overlap_steps
        for f in self.fragments:
            f.since += 1
            if f.work is not None and self.t >= f.due:  # launched `overlap` steps ago: mix it in now
                self._arrive(f, trainer, stats, self.options.mix_alpha)
            if self.t % h == f.offset:
                self._launch(f, trainer, stats, due=self.t + overlap)
                if overlap == 0:
                    self._arrive(f, trainer, stats, self.options.mix_alpha)
        stats.period = h  # the step rows' period (column tau) and averaging_round: H and outer steps so far
        stats.averaging_round = self.outer_steps
        return stats

    def close_period(self, trainer: Any) -> CommStats | None:
        """Close the period: fragments in flight arrive, every fragment changed since its last sync
        takes its outer step now, and every replica takes θ_g whole (α does not apply: the replicas
        must be one model for what reads them next). None: nothing to close."""
        stats, closed = CommStats(), False
        for f in self.fragments:
            if f.work is not None:
                self._arrive(f, trainer, stats, 0.0)
                closed = True
            if f.since > 0:
                self._launch(f, trainer, stats, due=self.t)
                self._arrive(f, trainer, stats, 0.0)
                closed = True
        self.t = 0
        if not closed:
            return None
        stats.averaging_round = self.outer_steps
        return stats

    def _launch(self, f: Fragment, trainer: Any, stats: CommStats, due: int) -> None:
        """Start the all-reduce of this fragment's pseudo-gradient θ_g − θ_i (in the background; under
        --compress the codec runs now, blocking, and the mean still waits until `due`)."""
        f.delta = self.pseudo_gradient(f, trainer)
        if self.tallies:
            weight = self.tallies[self.fragments.index(f)].take(self.slices_per_step)
            if weight != 1.0:
                f.delta.mul_(weight)
        f.work = self.channel.all_reduce_async(f.stream, f.delta)
        stats.add(f.work.traffic)
        f.due, f.since = due, 0

    def _arrive(self, f: Fragment, trainer: Any, stats: CommStats, alpha: float) -> None:
        """Wait for the fragment's mean pseudo-gradient, step its outer optimizer, mix θ_g into the replica:
        θ_i ← α·θ_i + (1 − α)·θ_g (α = 0: the replica takes θ_g)."""
        assert f.work is not None and f.delta is not None
        stats.seconds += f.work.wait()
        delta = f.delta
        # Skipped, the round is discarded: the replica's fragment goes back to θ_g (its inner optimizer
        # state stays as it is).
        if self.finite(self.agreed_finite(delta), "averaged pseudo-gradient"):
            self.outer_step(f, delta)
        else:
            stats.nonfinite = True
        self.mix(f, trainer, alpha)
        f.work, f.delta = None, None
        self.outer_steps += 1

    def fragment_scalars(self) -> dict[str, Any]:
        """For a checkpoint: each fragment's outer optimizer's own numbers (Adam's step), which the flat form
        keeps once (fragment 0's) though fragments step at different inner steps; nothing for one fragment."""
        if len(self.fragments) < 2:
            return {}
        return {"fragment_scalars": [f.scalars() for f in self.fragments]}

    def restore_fragment_scalars(self, state: dict[str, Any]) -> None:
        """After the outer optimizers' state is loaded: each fragment's own numbers back (a checkpoint
        written before they were kept, or by another --fragments, has none: fragment 0's stay)."""
        scalars = state.get("fragment_scalars")
        if scalars is not None and len(scalars) == len(self.fragments):
            for f, own in zip(self.fragments, scalars, strict=True):
                f.set_scalars(own)

    def pseudo_gradient(self, f: Fragment, trainer: Any) -> torch.Tensor:
        """This worker's values of θ_g − θ_i over fragment `f`, flat (a new tensor: it goes on the wire)."""
        raise NotImplementedError

    def agreed_finite(self, delta: torch.Tensor) -> bool:
        """Whether the mean pseudo-gradient is finite, the same answer on every worker of the run."""
        raise NotImplementedError

    def outer_step(self, f: Fragment, delta: torch.Tensor) -> None:
        """Step `f`'s outer optimizer on the mean pseudo-gradient `delta` (flat, as `pseudo_gradient`)."""
        raise NotImplementedError

    def mix(self, f: Fragment, trainer: Any, alpha: float) -> None:
        """θ_i ← α·θ_i + (1 − α)·θ_g over the fragment, in this worker's parameters."""
        raise NotImplementedError


@dataclass
class Fragment:
    """One fragment of θ: the whole tensors `tensors` (indices in parameter order), whose values are the
    span [lo, hi) of the whole model's flat buffer (the same cut on every worker, by the full tensors'
    sizes), θ_g for them with the fragment's outer optimizer, and its all-reduce while in flight. A plain
    replica's θ_g is one flat parameter (`param`); a cut replica's worker keeps its parts of the
    fragment's tensors, one parameter each (strategies/sharded_diloco.py)."""

    lo: int
    hi: int
    offset: int  # the fragment syncs at the inner steps t > 0 with t % H == offset
    tensors: range
    params: list[torch.nn.Parameter]  # θ_g
    outer: torch.optim.Optimizer
    since: int = 0  # inner steps since its last sync was launched
    work: Pending | None = None  # the all-reduce in flight
    delta: torch.Tensor | None = None
    due: int = 0  # the inner step at which it is mixed in
    stream: str = "pseudo_grads"  # the channel's stream for its pseudo-gradient

    @property
    def param(self) -> torch.nn.Parameter:
        """A plain replica's θ_g over the fragment: one flat parameter."""
        (param,) = self.params
        return param

    def scalars(self) -> dict[str, float]:
        """Its outer optimizer's per-optimizer numbers (Adam's step; none for SGD), the same for each of its
        parameters, which step together."""
        import torch

        from distrain.trainers.optim_state import SCALAR_STATE

        p = self.params[0]
        state = self.outer.state.get(p, {})
        return {
            key: float(value)
            for key, value in state.items()
            if value is not None and (key in SCALAR_STATE or not (torch.is_tensor(value) and value.shape == p.shape))
        }

    def set_scalars(self, scalars: dict[str, float]) -> None:
        """Put `scalars` into its outer optimizer's state, where torch keeps them, for each parameter with state."""
        import torch

        from distrain.trainers.optim_state import scalar_placement

        for p in self.params:
            state = self.outer.state.get(p)
            if state:
                state.update({k: torch.tensor(v, **scalar_placement(self.outer, p)) for k, v in scalars.items()})

    @classmethod
    def create(
        cls, lo: int, hi: int, offset: int, tensors: range, params_flat: torch.Tensor, options: DiLoCoOptions
    ) -> Fragment:
        """A plain replica's fragment: θ_g a flat copy of params_flat[lo:hi]."""
        import torch

        param = torch.nn.Parameter(params_flat[lo:hi].detach().clone())
        return cls(lo, hi, offset, tensors, [param], options.make_outer_optimizer(param))


def fragment_plan(sizes: list[int], fragments: int, sync_every: int) -> list[tuple[int, int, int, range]]:
    """Each fragment's span [lo, hi) of the flat model, its offset p·H/P in the period and its tensors'
    indices, for tensors of `sizes` (the whole tensors', in parameter order: the same on every worker,
    cut or not); its stream is `fragment_stream(p, fragments)`."""
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    plan = []
    for p, (lo, hi) in enumerate(fragment_spans(sizes, fragments)):
        tensors = range(starts.index(lo), starts.index(hi))
        plan.append((lo, hi, (p * sync_every) // fragments, tensors))
    return plan


def fragment_stream(p: int, fragments: int) -> str:
    """The channel's stream of fragment p's pseudo-gradient (one fragment: DiLoCo's "pseudo_grads")."""
    return "pseudo_grads" if fragments == 1 else f"pseudo_grads.{p}"


def fragment_spans(sizes: list[int], fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of `sizes` (in flat-buffer order) into `fragments` contiguous groups of whole tensors,
    of about equal numbers of values: a group ends at the first tensor that takes it to its share."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"{fragments} fragments of {len(sizes)} tensors")
    total, spans, lo, acc = sum(sizes), [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        left_tensors, left_groups = len(sizes) - i - 1, fragments - len(spans) - 1
        if left_groups == 0:
            continue
        if acc >= total * (len(spans) + 1) / fragments or left_tensors == left_groups:
            spans.append((lo, acc))
            lo = acc
    spans.append((lo, total))
    return spans
