"""Sharded checkpoints of cut replicas through torch.distributed.checkpoint (DCP): every worker writes
its own shards, in a background thread, and any layout reads them back.

A checkpoint is a DCP directory (`checkpoints/state-NNNNNNNN/`, by the global step) of flat entries:
- `model/<name>`: the model's state dict (parameters as the DTensors FSDP and TP made of them);
- `optim/<param name>/<key>`: the optimizer's per-value state (momentum buffers, Adam's moments), cut
  as their parameters are;
- `optim#/<key>`: the per-optimizer numbers (Adam's step), one 0-d tensor each (equal on every worker);
- a strategy's own, under its prefix (ShardedDiLoCo's outer optimizer: `outer/...`, `outer#/...`).
DCP's metadata records each entry's global shape and which worker wrote which piece, so a run at another
--fsdp or --tensor-parallel loads its own pieces from the same files (DCP reshards), and one process reads
the whole state (`read_whole`) for everything that wants it so: a run without sharding resuming,
--init-from, `distrain report`'s trained model. Entries are flat on purpose: DCP flattens nested dicts by
joining keys with ".", which parameter names contain already.

Saving is asynchronous (what `dcp.async_save` does, with what it makes per call kept for the run): the
worker blocks only while its shards are copied to CPU memory (staging, into buffers kept from one save
to the next: trainers/checkpoint_staging.py); one thread, the run's, writes them with `dcp.save` while
training goes on, over a process group of its own (the save's collectives must not interleave with the
training's on the run's group). The coordinator (rank 0)
writes DCP's `.metadata` last, so a directory with it is complete (`is_complete`): the driver points a
checkpoint file at a directory only then.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distrain.trainers.optim_state import SCALAR_STATE, FlatOptimizerState, scalar_placement

MODEL, OPTIM = "model", "optim"
METADATA = ".metadata"  # DCP's index, written last by the coordinator


def state_dir_name(global_step: int) -> str:
    return f"state-{global_step:08d}"


def is_complete(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def forget_save(directory: Path) -> None:
    """Make an earlier attempt's save in `directory` incomplete (its index gone), so that nobody takes it
    for the save about to be written there (the coordinator writes a new index last)."""
    (directory / METADATA).unlink(missing_ok=True)


def optimizer_entries(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], names: list[str], prefix: str = OPTIM
) -> dict[str, torch.Tensor]:
    """The optimizer's state as flat DCP entries: one tensor per parameter and key (cut as the parameter
    is), and the per-optimizer numbers once."""
    entries: dict[str, torch.Tensor] = {}
    for p, name in zip(params, names, strict=True):
        for key, value in optimizer.state.get(p, {}).items():
            if value is None:
                continue
            if key not in SCALAR_STATE and torch.is_tensor(value) and value.shape == p.shape:
                entries[f"{prefix}/{name}/{key}"] = value.detach()
            else:
                entries[f"{prefix}#/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return entries


def load_optimizer_entries(
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    names: list[str],
    directory: Path,
    prefix: str = OPTIM,
    process_group: Any = None,
) -> None:
    """Replace the optimizer's state with the checkpoint's, each worker reading its own pieces (a
    collective over the run's workers)."""
    import torch.distributed.checkpoint as dcp

    keys = _saved_keys(directory)
    targets: dict[str, torch.Tensor] = {}
    for p, name in zip(params, names, strict=True):
        for key in _keys_under(keys, f"{prefix}/{name}/"):
            targets[f"{prefix}/{name}/{key}"] = torch.zeros_like(p.detach())
    for key in _keys_under(keys, f"{prefix}#/"):
        targets[f"{prefix}#/{key}"] = torch.zeros((), dtype=torch.float64)
    dcp.load(targets, checkpoint_id=str(directory), process_group=process_group)
    optimizer.state.clear()
    scalars = {k[len(prefix) + 2 :]: float(v) for k, v in targets.items() if k.startswith(f"{prefix}#/")}
    for p, name in zip(params, names, strict=True):
        own = f"{prefix}/{name}/"
        state: dict[str, Any] = {k[len(own) :]: v for k, v in targets.items() if k.startswith(own)}
        state |= {k: torch.tensor(v, **scalar_placement(optimizer, p)) for k, v in scalars.items()}
        if state:
            optimizer.state[p] = state


def load_model_entries(model: nn.Module, directory: Path, process_group: Any = None) -> None:
    """Load the checkpoint's model state into `model` in place, each worker its own pieces."""
    import torch.distributed.checkpoint as dcp

    own = model.state_dict()
    targets = {f"{MODEL}/{k}": v for k, v in own.items()}
    dcp.load(targets, checkpoint_id=str(directory), process_group=process_group)
    model.load_state_dict({k: targets[f"{MODEL}/{k}"] for k in own})


def read_whole(
    directory: Path, model_keys: list[str], param_names: list[str], strategy_state: Any = None
) -> dict[str, Any]:
    """The whole state in one process: {"model": state dict, "optimizer": flat optimizer state} (the
    layout-free form orchestrator/checkpoint.py writes for unsharded runs), and `strategy_state` (a
    checkpoint's {"strategy", "state"}) with each {"sharded": prefix} entry made that flat state too."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    entries: dict[str, Any] = {}
    _load_state_dict(
        entries, storage_reader=FileSystemReader(str(directory)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    model = {k: entries[f"{MODEL}/{k}"] for k in model_keys}
    whole: dict[str, Any] = {"model": model, "optimizer": whole_optimizer(entries, param_names).to_dict()}
    if strategy_state is not None:
        own = dict(strategy_state["state"])
        for key, value in own.items():
            if isinstance(value, dict) and "sharded" in value:
                own[key] = whole_optimizer(entries, param_names, value["sharded"]).to_dict()
        whole["strategy_state"] = strategy_state | {"state": own}
    return whole


def whole_optimizer(entries: dict[str, Any], param_names: list[str], prefix: str = OPTIM) -> FlatOptimizerState:
    """The flat optimizer state from whole DCP entries, the vectors in parameter order."""
    keys = _keys_under(entries, f"{prefix}/{param_names[0]}/") if param_names else []
    vectors = {key: torch.cat([entries[f"{prefix}/{n}/{key}"].reshape(-1) for n in param_names]) for key in keys}
    scalars = {k[len(prefix) + 2 :]: float(v) for k, v in entries.items() if k.startswith(f"{prefix}#/")}
    return FlatOptimizerState(vectors, scalars)


def saved_values(directory: Path) -> int:
    """The model's floating-point values in a sharded checkpoint, from DCP's metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return sum(
        int(torch.Size(item.size).numel())
        for key, item in meta.items()
        if key.startswith(f"{MODEL}/") and hasattr(item, "size") and item.properties.dtype.is_floating_point
    )


def _saved_keys(directory: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def _keys_under(keys: Iterable[str], prefix: str) -> list[str]:
    return [k[len(prefix) :] for k in keys if k.startswith(prefix) and "/" not in k[len(prefix) :]]


class AsyncSaver:
    """A worker's side of the run's sharded checkpoints: one save in flight at a time (DCP's advice: wait
    for the last before the next), over a process group, a writer thread and staging buffers made once
    for the run (`dcp.async_save` would make a stager and a thread per save)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor
        from datetime import timedelta

        import torch.distributed as dist
        import torch.distributed.checkpoint  # noqa: F401  (here, not in the first save's blocking window: ~0.1 CPU-s)

        from distrain.trainers.checkpoint_staging import StagingBuffers

        # Every worker makes it at set-up, in the same order (a collective); gloo: the thread's
        # collectives run on the CPU beside the training's. `timeout_s`: the run's --collective-timeout-s
        # (without it, gloo's 30 minutes: a save's collective with a lost worker would hold the rest).
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: Any = None
        self.staging = StagingBuffers()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distrain-checkpoint")
        # --storage: copies this worker's own files of each save there once it is written (the worker
        # sets it; orchestrator/storage.py). On another node than the driver they exist only here.
        self.upload: Any = None
        self._uploaded: Any = None

    def save(self, entries: dict[str, torch.Tensor], directory: Path) -> None:
        """Begin writing `entries` to `directory`, once the previous save is written: training waits for
        that and for this one's tensors to be staged (copied to CPU memory), not for the writing."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # the staging buffers hold the previous save's state until it is written
        directory.mkdir(parents=True, exist_ok=True)
        staged = self.staging.stage(entries)
        self.pending = self._writer.submit(dcp.save, staged, checkpoint_id=str(directory), process_group=self.group)
        if self.upload is not None:
            import threading

            import torch.distributed as dist

            rank, done = dist.get_rank(self.group), threading.Event()
            self._uploaded = (done, [])
            self.pending.add_done_callback(lambda future: self._upload(future, directory, rank, done))

    def close(self) -> None:
        """The save in flight written, then the thread and the buffers let go (a run's end)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self.staging.clear()

    def _upload(self, future: Any, directory: Path, rank: int, done: Any) -> None:
        """In the save's thread, once it is written: this worker's files (DCP names them by its rank in the
        save's group; the coordinator's index last), without holding up training."""
        try:
            if future.exception() is None:
                own = sorted(directory.glob(f"__{rank}_*")) + sorted(directory.glob(f"__{rank}{METADATA}"))
                self.upload(own + ([directory / METADATA] if rank == 0 else []))
        except Exception as e:  # raised by wait(), on the training thread
            self._uploaded[1].append(e)
        finally:
            done.set()

    def wait(self) -> None:
        """Until the save in flight (if any) is written (and copied to --storage); its error, if it failed,
        raised here."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()
        if self._uploaded is not None:
            (done, errors), self._uploaded = self._uploaded, None
            done.wait()
            if errors:
                raise errors[0]
