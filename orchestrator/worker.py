"""The worker actor: one trainer + one strategy, running its own training loop in segments.

The driver hands a worker a segment of work units at a time (`run_segment`) and gets back that
segment's metrics rows as columns, so it is off the per-step path and gathers metrics in batches.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from distrain.actor_process import freeze_loaded_libraries
from distrain.config import RunConfig
from distrain.config.groups_section import worker_cpus
from distrain.config.shares_section import unequal_shares
from distrain.errors import ResourceError
from distrain.orchestrator.checkpoint import CHECKPOINTS
from distrain.orchestrator.checkpoint_schedule import CheckpointSchedule
from distrain.orchestrator.gpu_stats import GpuStats
from distrain.orchestrator.metrics import LOGGED_PREFIX, SCHEMA
from distrain.orchestrator.peak_memory import PeakMemory
from distrain.orchestrator.streaming import Shard, StreamReader, by_value, is_dataset, test_batches
from distrain.orchestrator.tasks import build_task
from distrain.plugins import USER_MODULE_PREFIX
from distrain.strategies.base import CommStats, NonFinite, Strategy, StrategyContext
from distrain.strategies.collective import host_rendezvous
from distrain.strategies.elastic_group import GroupBroken, param_digest
from distrain.strategies.step_columns import family_fields
from distrain.strategies.strategy_lookup import strategy_class
from distrain.trainers.local_trainer import LocalTrainer
from distrain.trainers.models import seed_globals, seeded, use_deterministic_kernels
from distrain.trainers.schedule import LRSchedule
from distrain.trainers.sharded_trainer import ShardedTrainer
from distrain.trainers.sharding import EpochSharder
from distrain.trainers.splits import task_splits
from distrain.trainers.task import BatchReader, DeviceCopy, pins_memory

EVAL_BATCH = 512  # test samples per evaluation batch

# The columns of a step row, in the schema's order (the strategies' column families included).
STEP_COLUMNS = tuple(n for n in SCHEMA.names if n not in ("run_id", "kind", "test_loss", "test_accuracy", "eval_s"))


class TrainWorker:
    """Hosted as a Ray actor by the orchestrator (`ray.remote(TrainWorker)`)."""

    def __init__(self, config: RunConfig, rank: int, run_start: float, data: Shard | None = None) -> None:
        freeze_loaded_libraries()  # `retire`'s garbage collection then scans only the runs' objects
        torch.set_num_threads(max(1, int(worker_cpus(config, rank))))
        seed_globals(config.seed, rank)  # dropout, augmentation: the same --seed draws the same (per rank)
        if config.deterministic:
            use_deterministic_kernels()
        self.config = config
        self.rank = rank
        self.world_size = config.num_worker_actors
        self.run_start = run_start
        self.slowdown = config.stragglers.get(rank)  # --straggler: injected, counted as compute
        self.device = "cuda" if config.uses_gpus else "cpu"
        self.peak_memory = PeakMemory(self.device)  # from here: building the replica counts towards the peak
        self.gpu_stats = GpuStats(self.device)  # NVML's utilisation and memory (null columns without it)
        self.strategy: Any = None
        self.strategy_state: dict[str, Any] | None = None  # a checkpoint's, until the strategy is set up
        self.channel_state: dict[str, Any] | None = None  # this rank's codec state from a checkpoint, likewise
        # An error while building the replica (the task, its data, its model) is raised by the first
        # call instead (`describe`, or `setup` for a replacement): the driver then gets the exception
        # itself (a ConfigError stays one line, a bug in the user's task keeps its traceback) and never
        # takes it for a dead actor to retry.
        self.init_error: Exception | None = None
        built = time.perf_counter()
        try:
            self._build(config, data)
        except Exception as e:  # noqa: BLE001 - re-raised, unchanged, by the first call
            self.init_error = e
        self.build_s = time.perf_counter() - built  # the task, its data, the model: the start-up's "data"

    def _build(self, config: RunConfig, data: Shard | None) -> None:
        if config.uses_gpus and not torch.cuda.is_available():
            # Ray gave this actor a GPU, but torch cannot use one (a CPU build of torch, a driver that does
            # not match, CUDA_VISIBLE_DEVICES empty): training on the CPU instead would be silently slow.
            raise ResourceError(
                f"worker {self.rank} was given {config.gpus_per_worker:g} GPU(s) but torch {torch.__version__} "
                f"sees no CUDA device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                "install a CUDA build of torch on the workers, or drop --gpus-per-worker"
            )
        # The task's data is built here, in the worker's own process: nothing passes through the driver.
        self.task = build_task(config)
        # A streamed training set (a Ray Dataset, orchestrator/streaming.py) is read from `data`, this
        # worker's shard of the driver's split; the one built here only plans its reads and is dropped.
        splits = task_splits(self.task, config.val_fraction)
        train, self.val_is_test = splits.train, splits.val_is_test
        self.eval_sets = {"val": splits.val, "test": splits.test}
        if any(is_dataset(ds) for ds in self.eval_sets.values()):  # streamed by this worker's evaluation
            by_value(self.task)
        # On a CUDA device the prefetched batch is pinned on the reader thread: its copy is then asynchronous.
        pin = pins_memory(self.device)
        self.stream: StreamReader | None = None
        self.train_reader = BatchReader(train, self.task.collate, prefetch=config.prefetch, pin=pin)
        self.eval_readers = {k: BatchReader(ds, self.task.collate, prefetch=False) for k, ds in self.eval_sets.items()}
        model = seeded(self.task.build_model, config.seed)
        self.full_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.stage_plan = None
        if config.pipelined:  # this actor keeps one stage (config/layout_section.py `position_of`)
            from distrain.config.layout_section import position_of
            from distrain.strategies.pipeline import plan_stages_for
            from distrain.trainers.pipeline_split import stage_module

            self.stage_plan = plan_stages_for(model, self.task.split_points(), config)
            self.stage = position_of(config, self.rank).stage
            model = stage_module(model, self.stage_plan, self.stage)
        self.trainer = self._make_trainer(model)
        self.device_copy = DeviceCopy(self.trainer.device)
        # A full-batch strategy's step is one pass over the whole training set: one step per epoch.
        full_batch = strategy_class(config.strategy).full_batch
        rows = data.rows if data is not None else len(train)
        self.sharder = EpochSharder(rows, rows if full_batch else config.samples_per_step, config.seed)
        if data is not None:
            self.stream = StreamReader(data, self.task.collate_columns, self.sharder.steps_per_epoch)
        # Heterogeneous workers (--worker-weights, --balance speed): each worker's samples per step, in rank
        # order (a replica's, for a pipeline's or a cut replica's workers; None: equal slices); `weighs`: the
        # strategy is told each step's share (even an equal one).
        self.shares = config.worker_shares
        self.weighs = unequal_shares(config)
        # The run's end, and where checkpoints are taken: as the driver's dispatcher queues them (one rule).
        self.checkpoints = CheckpointSchedule.of_run(config, self.sharder.steps_per_epoch)
        self.total_steps = self.checkpoints.total_steps
        self.schedule = LRSchedule.create(
            config.lr,
            config.global_batch_size,
            config.base_batch_size,
            config.lr_scaling,
            config.warmup_epochs,
            self.sharder.steps_per_epoch,
            decay=config.lr_decay,
            total_steps=self.total_steps,
            min_lr=config.lr_min,
            decay_epochs=config.lr_decay_epochs,
            gamma=config.lr_decay_gamma,
        )

    def _make_trainer(self, model: Any) -> Any:
        """The trainer of `model` (a sharded replica's keeps the whole model until its strategy cuts it)."""
        config = self.config
        trainer_class = ShardedTrainer if config.sharded else LocalTrainer
        return trainer_class(
            model,
            self.task,
            config.optimizer,
            config.lr,
            config.momentum,
            config.weight_decay,
            self.device,
            config.optimizer_args,
            config.precision,
            accumulate_steps=config.accumulate_steps,
            clip_grad_norm=config.clip_grad_norm,
        )

    def _built(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    # ------------------------------------------------------------------ set-up
    def describe(self) -> dict[str, Any]:
        self._built()
        return {
            "rank": self.rank,
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "device": self.device,
            "steps_per_epoch": self.sharder.steps_per_epoch,
            "num_params": self.full_params,
            "param_bytes": self.trainer.nbytes,  # what this actor holds (a pipeline stage: its slice)
            "val_is_test": self.val_is_test,  # no validation split: runs select on the test set
            "build_s": self.build_s,
        }

    def rendezvous_address(self) -> str:
        return host_rendezvous(ray.util.get_node_ip_address(), self.config.collective_timeout_s)

    def load_state(self, state: dict[str, Any]) -> None:
        """Start from a checkpoint's model and (flat) optimizer state; the strategy's own state and this
        rank's codec state (`channel`: residuals, warm starts), if the checkpoint has them, are handed to
        the strategy and its channel once `setup` has built them."""
        if self.stage_plan is not None and "sharded" not in state:  # a full state dict: this stage's keys and slice
            from distrain.trainers.optim_state import FlatOptimizerState

            keys = set(self.trainer.model.state_dict())
            start = self.stage_plan.offset(self.stage)
            flat = FlatOptimizerState.from_dict(state["optimizer"]).slice(start, start + self.trainer.numel)
            state = state | {
                "model": {k: v for k, v in state["model"].items() if k in keys},
                "optimizer": flat.to_dict(),
            }
        if "sharded" in state:  # a sharded checkpoint: the directory, in this run's checkpoints folder
            path = Path(self.config.run_dir) / CHECKPOINTS / state["sharded"]["dir"]
            state = state | {"sharded": state["sharded"] | {"path": str(path)}}
        self.trainer.load_state_dict(state)
        self.strategy_state = state.get("strategy_state")
        self.channel_state = state.get("channel")

    def setup(
        self,
        rendezvous: str,
        ps_shards: list[Any],
        ps_bounds: list[tuple[int, int]],
        driver_actors: dict[str, Any] | None = None,
        phase_config: RunConfig | None = None,
    ) -> None:
        """Join the transport of the run's strategy, or of `phase_config`'s (one phase of a --schedule);
        `driver_actors`: the handles of the driver-side actors it declared, by spec name."""
        self._built()
        config = phase_config or self.config
        ctx = StrategyContext(
            self.rank,
            self.world_size,
            self.device,
            rendezvous,
            tuple(ps_shards),
            tuple(ps_bounds),
            dict(driver_actors or {}),
            self.total_steps,
        )
        impl = strategy_class(config.strategy).implementation(config)
        self.strategy = impl(config, ctx)
        self.strategy.setup(self.trainer)
        saver = getattr(self.strategy, "saver", None)  # a sharded replica's checkpoint shards: its own copy
        if saver is not None and config.storage:  # to --storage (the driver's sync leaves state-*/ alone)
            from distrain.orchestrator.storage import upload_files

            saver.upload = functools.partial(upload_files, Path(config.run_dir), config.storage)
        self.columns = STEP_COLUMNS + tuple(c for c in impl.metric_columns if c not in STEP_COLUMNS)
        saved, self.strategy_state = self.strategy_state, None
        if saved is not None and saved.get("strategy") == self.strategy.name:
            self.strategy.load_extra_state(saved["state"])
        channel, self.channel_state = self.channel_state, None  # only the phase the checkpoint was taken in
        if channel:
            self.strategy.channel.load_state_dict(channel)

    # ------------------------------------------------------------------ training
    def run_segment(self, units: list[tuple[int, int, int]], shares: list[int] | None = None) -> dict[str, list[Any]]:
        """Train on `units` ((epoch, step, slice) each), in order; returns their rows as columns.
        `shares` (--balance speed): every worker's samples per step from this segment on, the same for
        every worker's segment at these steps (the driver's orchestrator/balance.py decides them).

        The strategy may skip units or trade them for others (`Strategy.plan`); each computed unit
        gets one row.
        """
        if shares is not None:
            cut = self.strategy.share_cut  # (a cut replica's share is one per replica)
            if len(shares) * cut != self.strategy.slices_per_step or sum(shares) != self.sharder.global_batch:
                raise ValueError(f"shares {shares} do not cut a step of {self.sharder.global_batch} samples")
            self.shares = tuple(shares)
        rows: dict[str, list[Any]] = {c: [] for c in self.columns}
        diverged: dict[str, Any] | None = None
        # A strategy that computes the units as given (no portions handed out on the way) lets the
        # next unit's batch be read while this one trains.
        ahead = list(units) if type(self.strategy).plan is Strategy.plan else []
        rounds = 0  # steps completed (elastic BSP: rounds, a placeholder's included)
        broken: list[str] = []  # the plan's own collectives failed (a cut replica entering BSP rounds)
        for i, (epoch, step, slice_) in enumerate(self._planned(units, broken)):
            global_step = epoch * self.sharder.steps_per_epoch + step
            lr = self.schedule.lr_at(global_step)
            t0 = time.perf_counter()
            if slice_ < 0:  # elastic BSP: no unit for this member in this round; it joins the all-reduce
                try:
                    if getattr(self.strategy, "sits_out_on_a_batch", False):  # FSDP: its collectives need a pass
                        batch = self.train_reader.read(self._indices(epoch, step, 0))
                        self.strategy.sit_out_on(self.trainer, self.device_copy.move(batch))
                    else:
                        self.strategy.sit_out(self.trainer)
                    self.strategy.step(self.trainer, lr)
                except GroupBroken as e:
                    rows["broken"] = [{"rounds": rounds, "error": str(e)}]
                    break
                rounds += 1
                continue
            # A strategy may compute a unit its own way (Sandblaster: the portions of an outer iteration).
            own = self.strategy.run_unit(self.trainer, self.train_reader, global_step)
            h2d_s = None
            if own is None:
                if self.stream is not None:  # the next batch of this worker's shard (its own prefetch)
                    batch, read = self.stream.read(epoch, step)
                else:
                    slices = self.strategy.unit_slices(slice_)
                    idx = (
                        self._indices(epoch, step, slice_)
                        if len(slices) == 1
                        else np.concatenate([self._indices(epoch, step, s) for s in slices])
                    )
                    batch, read = self.train_reader.read(idx), len(idx)
                    if self.weighs:  # its gradient stands for its share of the step's samples
                        self.strategy.weigh_share(len(idx), self.sharder.global_batch)
                    if i + 1 < len(ahead) and ahead[i + 1][2] >= 0:
                        self.train_reader.prefetch(self._indices(*ahead[i + 1]))
                # Moved here, timed (`h2d_s`); the trainer's own `to_device` then finds it in place.
                batch = self.device_copy.move(batch)
                try:
                    loss = self.strategy.compute_gradients(self.trainer, batch)
                except GroupBroken as e:  # elastic across cut replicas: FSDP's collectives lost a peer
                    rows["broken"] = [{"rounds": rounds, "error": str(e)}]
                    break
                samples = read if self.strategy.counts_samples else 0
            else:
                loss, samples = own
            if self.slowdown and own is None:  # (a strategy running its own units applies it per its own unit)
                time.sleep(self.slowdown.extra_s(time.perf_counter() - t0))
            compute_s = time.perf_counter() - t0
            if own is None:
                h2d_s = self.device_copy.seconds()
            overflows = self.strategy.overflow_skips  # fp16 loss-scale overflows before this step
            try:
                comm = self.strategy.step(self.trainer, lr)
                # One well-defined model after an epoch's end or a checkpoint's step (CheckpointSchedule):
                # strategies with local periods (local SGD, DiLoCo) average there.
                if self.checkpoints.closes_period(global_step + 1):
                    extra = self.strategy.at_epoch_end(self.trainer)
                    if extra is not None:  # e.g. local SGD's closing average: counted in this step's row
                        comm.seconds += extra.seconds
                        comm.bytes_sent += extra.bytes_sent
                        comm.bytes_received += extra.bytes_received
                        if extra.bytes_uncompressed is not None:
                            comm.bytes_uncompressed = (comm.bytes_uncompressed or 0) + extra.bytes_uncompressed
                        comm.averaging_round = extra.averaging_round
                        comm.nonfinite = comm.nonfinite or extra.nonfinite
                        comm.extra.update(extra.extra)
                if self.checkpoints.taken_after(global_step + 1):  # sharded replicas write their own
                    directory = Path(self.config.run_dir) / CHECKPOINTS
                    saved = self.strategy.checkpoint_shards(self.trainer, global_step + 1, directory)
                    if saved is not None:
                        comm.extra["ckpt_block_s"] = saved.blocked_s
                        if not saved.finite:  # not a metrics column: the driver writes no such checkpoint
                            rows.setdefault("nonfinite_shards", []).append(global_step + 1)
            except NonFinite as e:  # --on-nonfinite stop: this step's row, then back to the driver
                comm = CommStats(nonfinite=True)
                diverged = {"step": global_step, "worker": self.rank, "what": str(e)}
            except GroupBroken as e:  # a peer left mid-round: abandoned, not applied; the driver re-forms
                rows["broken"] = [{"rounds": rounds, "error": str(e)}]
                break
            rounds += 1
            values = {
                "worker": self.rank,
                "step": global_step,
                "slice": slice_,
                "epoch": epoch,
                "loss": loss,
                "lr": comm.lr if comm.lr is not None else self.trainer.applied_lr if self.trainer.own_optimizer else lr,
                "samples": samples,
                "compute_s": compute_s,
                "comm_s": comm.seconds,
                "h2d_s": h2d_s,
                "bytes_sent": comm.bytes_sent,
                "bytes_received": comm.bytes_received,
                "wall_time": time.time() - self.run_start,
                # the strategies' column families: `CommStats` fields, by the families' declarations
                **{column: getattr(comm, name) for column, name in family_fields().items()},
                "nonfinite": comm.nonfinite,
                "overflow": True if self.strategy.overflow_skips > overflows else None,
                "bytes_uncompressed": comm.bytes_uncompressed,
                **self.peak_memory.sample(),  # mem_peak_bytes, gpu_peak_bytes
                **self.gpu_stats.sample(),  # gpu_util, gpu_mem_bytes
            } | {c: comm.extra.get(c) for c in type(self.strategy).metric_columns}
            for key, value in values.items():
                rows[key].append(value)
            logs = self.trainer.last_logs if own is None else None  # the task's own scalars (Task.loss)
            if logs:
                n = len(rows["step"]) - 1  # this row's index: earlier rows of the segment logged none
                for name, value in logs.items():
                    rows.setdefault(f"{LOGGED_PREFIX}{name}", [None] * n).append(value)
            if diverged is not None:
                break
        if broken and "broken" not in rows:
            rows["broken"] = [{"rounds": rounds, "error": broken[0]}]
        for key in rows:  # a name missing from the later rows: null there
            if key.startswith(LOGGED_PREFIX):
                rows[key].extend([None] * (len(rows["step"]) - len(rows[key])))
        try:
            self.strategy.settle(rows)
        except GroupBroken as e:  # elastic local SGD: the block's average failed, the block is undone
            rows = {c: [] for c in self.columns} | {"broken": [{"rounds": 0, "error": str(e)}]}
        if diverged is not None:
            rows["diverged"] = [diverged]  # not a metrics column: the driver takes it out
        elif "broken" not in rows and units:
            self._attach_channel_state(rows, units[-1])
        return rows

    def _planned(self, units: list[tuple[int, int, int]], broken: list[str]) -> Iterator[tuple[int, int, int]]:
        """The strategy's plan of `units`; a `GroupBroken` raised by the plan itself (its collectives) ends
        it, the error put in `broken`."""
        try:
            yield from self.strategy.plan(units)
        except GroupBroken as e:
            broken.append(str(e))

    def _attach_channel_state(self, rows: dict[str, list[Any]], last: tuple[int, int, int]) -> None:
        """A segment that ends where a checkpoint is taken (a step or epoch checkpoint, or the run's end)
        carries this rank's codec state as it is there (not a metrics column: the driver takes it out and
        puts every rank's into that checkpoint). The residuals differ per rank, so rank 0's `state` call
        cannot speak for the others; shipping them with the segment needs no call that could wait
        behind a later segment."""
        end = last[0] * self.sharder.steps_per_epoch + last[1] + 1
        if not self.checkpoints.taken_after(end):
            return
        state = self.strategy.channel.state_dict()  # empty without a codec
        if state:
            rows["channel_state"] = [{"step": end, "state": state}]

    def _indices(self, epoch: int, step: int, slice_: int) -> np.ndarray:
        strategy = self.strategy
        return self.sharder.worker_indices(
            epoch, step, slice_, strategy.slices_per_step, self.shares, strategy.share_cut if self.shares else 1
        )

    def evaluate(
        self, shard: int, num_shards: int, splits: tuple[str, ...] = ("val",)
    ) -> tuple[dict[str, dict[str, tuple[float, float]]], float]:
        """Score this worker's contiguous share of each of `splits` ("val", "test"): ({split: (sum, count)
        per metric}, seconds). A task without a validation split of its own validates on the test set,
        scored once for both."""
        t0 = time.perf_counter()
        self.strategy.prepare_eval(self.trainer)
        shard, num_shards = self.strategy.eval_share(shard, num_shards)
        scored: dict[str, dict[str, tuple[float, float]]] = {}
        for split in ("test", "val") if self.val_is_test else splits:
            if self.val_is_test and split == "val":
                scored["val"] = scored["test"]
                continue
            data = self.eval_sets[split]
            if is_dataset(data):  # a streamed set: share 0 streams it whole
                batches = test_batches(data, self.task.collate_columns, shard, EVAL_BATCH)
            else:
                n, reader = len(data), self.eval_readers[split]
                lo, hi = n * shard // num_shards, n * (shard + 1) // num_shards
                batches = (reader.read(np.arange(i, min(i + EVAL_BATCH, hi))) for i in range(lo, hi, EVAL_BATCH))
            scored[split] = self.strategy.evaluate(self.trainer, batches)
        return scored, time.perf_counter() - t0

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """Model and flat optimizer state, as the strategy defines them (PS: the shards' snapshot)."""
        state = self.strategy.export_state(self.trainer) | self.trainer.scaler_state()
        extra = self.strategy.extra_state()
        if extra is not None:  # tagged: only the same strategy takes it back (not the next phase's)
            state["strategy_state"] = {"strategy": self.strategy.name, "state": extra}
        return state

    def save_shards(self, step: int) -> bool:
        """Begin this worker's shards of a checkpoint of the state now, after `step` steps (every worker of
        a sharded run at once): the final one, where a callback's stop ended the run between checkpoints.
        Returns whether its parameters were finite."""
        saved = self.strategy.checkpoint_shards(self.trainer, step, Path(self.config.run_dir) / CHECKPOINTS)
        return saved is None or saved.finite

    def channel_state(self) -> dict[str, Any]:
        """This rank's codec state as it is now (empty without a codec): once every call is done, the
        state after its last segment (orchestrator/controller/attempt.py asks for the final checkpoint's
        where a callback's stop moved the end after the segments were sent)."""
        return self.strategy.channel.state_dict() if self.strategy is not None else {}

    def reform(self, rendezvous: str, group_rank: int, group_size: int, src: int) -> dict[str, Any]:
        """Elastic BSP over the collective (orchestrator/controller/collective_scaling.py): join the new
        group, then take the whole replica state (parameters, optimizer state, fp16 loss scale, the strategy's own)
        by broadcast from group rank `src`, a member that trained on: nothing is read from disk. Returns
        the parameters' digests before and after, and the seconds it took."""
        import torch.distributed as dist

        if getattr(self.strategy, "rebuilds_replica", False):  # elastic across cut replicas
            return self._reform_cut(rendezvous, group_rank, group_size, src)
        t0 = time.perf_counter()
        before = param_digest(self.trainer.params_flat)
        scale = self.trainer.scaler.scale if self.trainer.scaler is not None else None
        self.strategy.reform(group_rank, group_size, rendezvous)
        box = [self.state() if group_rank == src else None]
        if group_size > 1:
            dist.broadcast_object_list(box, src=src)
        if group_rank != src:
            self.load_state(box[0])
            saved, self.strategy_state = self.strategy_state, None
            if saved is not None and saved.get("strategy") == self.strategy.name:
                self.strategy.load_extra_state(saved["state"])
        self.strategy.reformed(self.trainer)
        after = param_digest(self.trainer.params_flat)
        result = {"before": before, "after": after, "seconds": time.perf_counter() - t0}
        if self.trainer.scaler is not None:  # fp16's loss scale, with the state (before: own; after: the source's)
            result["scale"] = [scale, self.trainer.scaler.scale]
        return result

    def _reform_cut(self, rendezvous: str, group_rank: int, group_size: int, src: int) -> dict[str, Any]:
        """`reform` for a cut replica's worker (strategies/elastic_cut.py): join the new group, cut a fresh
        trainer over the new (R', D, T) mesh, put this worker's own pieces back (and fp16's loss scale),
        then take those of the source replica's worker at its place (d, t) (a broadcast over the mesh's
        "replicate" group: a joiner gets a live replica's pieces and scale, a survivor a round further goes
        back to the source's), the strategy's own pieces with them (DiLoCo's outer optimizer state). Digests
        are of the local pieces; `scale`: fp16's loss scale before and after."""
        import torch.distributed as dist

        from distrain.trainers import replica_shards

        t0 = time.perf_counter()
        before = replica_shards.digest(self.trainer)
        scale = self.trainer.scaler.scale if self.trainer.scaler is not None else None
        kept = self._cut_pieces() if self.trainer.optimizer is not None else None
        self.strategy.reform(group_rank, group_size, rendezvous)
        if kept is not None:  # cut over the old group's mesh: a fresh trainer for the new one
            self.trainer = self._make_trainer(seeded(self.task.build_model, self.config.seed))
        mesh = self.strategy.cut(self.trainer, group_size)
        if kept is not None:
            self._put_cut_pieces(kept)
        per = self.strategy.shards * self.strategy.tp  # a replica's workers: rank = (replica x D + d) x T + t
        source, mine, place = src // per, group_rank // per, group_rank % per
        box = [self._cut_pieces() if mine == source else None]
        if group_size > per:
            dist.broadcast_object_list(box, src=source * per + place, group=mesh["replicate"].get_group())
        if mine != source:
            self._put_cut_pieces(box[0])
        self.strategy.reformed(self.trainer)
        after = replica_shards.digest(self.trainer)
        result = {"before": before, "after": after, "seconds": time.perf_counter() - t0}
        if self.trainer.scaler is not None:
            result["scale"] = [scale, self.trainer.scaler.scale]
        return result

    def _cut_pieces(self) -> dict[str, Any]:
        """This worker's pieces of the replica (trainers/replica_shards.py) and of its strategy's own state."""
        from distrain.trainers import replica_shards

        return replica_shards.local_state(self.trainer) | {"strategy": self.strategy.local_extra()}

    def _put_cut_pieces(self, pieces: dict[str, Any]) -> None:
        from distrain.trainers import replica_shards

        replica_shards.load_local(self.trainer, pieces)
        self.strategy.load_local_extra(pieces["strategy"])

    def flat_params(self) -> np.ndarray:
        """The whole flat θ (a cut replica's worker: before its strategy's setup has cut the model)."""
        if isinstance(self.trainer, ShardedTrainer):
            return self.trainer.whole_flat().numpy().copy()
        return self.trainer.params_flat.detach().cpu().numpy().copy()

    def param_shapes(self) -> list[tuple[int, ...]]:
        """The whole shapes of the model's trainable parameters, in order (the PS shards' layout under --fsdp)."""
        return [tuple(p.shape) for p in self.trainer.model.parameters() if p.requires_grad]

    def param_cut_dims(self, tp: int) -> list[int | None]:
        """For each trainable parameter, in order, the dimension the task's plan splits it along across `tp`
        workers, None where every worker holds it whole (the PS shards' layout under --tensor-parallel)."""
        from distrain.trainers.tensor_parallel import cut_dims

        return cut_dims(self.trainer.model, self.trainer.task.tensor_parallel_plan(tp) or {})

    def hang(self) -> None:
        """Fault injection (--chaos hang-worker): stop answering, as a deadlocked process would."""
        time.sleep(10**6)

    def shutdown(self) -> None:
        """Leave the transports cleanly (the orchestrator kills the actor afterwards either way)."""
        if self.strategy is not None:
            self.strategy.teardown()
            self.strategy = None

    # ------------------------------------------------------------------ a warm worker (orchestrator/warm_pool.py)
    def retire(self) -> str:
        """After a completed run: leave the transports, drop the replica (model, data, reader threads) and
        keep only the process, warm, for the next run in this Ray session. Returns this actor's node id."""
        self.shutdown()
        for reader in [getattr(self, "train_reader", None), getattr(self, "stream", None)]:
            if reader is not None:
                reader.close()
        for reader in getattr(self, "eval_readers", {}).values():
            reader.close()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # a strategy that left one behind: not the next run's
        self.__dict__.clear()
        gc.collect()
        return ray.get_runtime_context().get_node_id()

    def rebuild(self, config: RunConfig, rank: int, run_start: float, data: Shard | None = None) -> None:
        """A warm worker taken for a new run: built as a fresh actor would be (its global RNGs seeded by
        `__init__`; a task file imported again, so an edited one is read as it is now)."""
        for name in [m for m in sys.modules if m.startswith(USER_MODULE_PREFIX)]:
            del sys.modules[name]
        self.__init__(config, rank, run_start, data)  # type: ignore[misc]

    def alive(self) -> bool:
        return True
