"""Collective transport: a torch.distributed process group across the worker actors.

gloo on CPU, NCCL when each worker holds a GPU of its own, gloo over CUDA tensors when workers share
GPUs (see `backend_for`). Rank 0 publishes "host:port" (see `free_address`) and
every rank joins through a TCP rendezvous. Each worker actor is its own process, so the default
process group is the group.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from distrain.strategies.network import Link


def free_address(host: str) -> str:
    """A "host:port" on this node that was free a moment ago (for tests and benchmarks that start their
    own processes; a run's group uses `host_rendezvous`, which cannot lose its port to another process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


# The rendezvous stores this process hosts, by their "host:port" (`host_rendezvous`), until its group starts.
_HOSTED: dict[str, dist.TCPStore] = {}


def host_rendezvous(host: str, timeout_s: float = 300.0) -> str:
    """Start a group's rendezvous store in this process, on a port the OS picks, and return its "host:port".

    The store listens from here on, so the port cannot be taken by another process between being chosen
    and the group starting: a free port looked up first and bound later by torch's `tcp://` init could be,
    and then rank 0 failed with EADDRINUSE (seen in CI with other tests' groups starting at the same time).
    The `CollectiveGroup` this process then joins at that address uses the store."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    address = f"{host}:{store.port}"
    _HOSTED[address] = store
    return address


def backend_for(device: str, gpus_per_worker: float) -> str:
    """The process group's backend. NCCL needs one GPU per rank: ranks on a shared GPU (a fractional
    --gpus-per-worker, the only way to run N > 1 on a one-GPU machine) fail its init with "Duplicate GPU
    detected". gloo all-reduces CUDA tensors too (through host memory, slower), so shared GPUs use gloo."""
    if not device.startswith("cuda"):
        return "gloo"
    return "nccl" if gpus_per_worker >= 1 else "gloo"


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes each worker sends (and receives) in a ring all-reduce of `nbytes`: 2(P-1)/P * n."""
    return 2 * (world_size - 1) * nbytes // world_size


def group_options(backend: str, timeout_s: float) -> object:
    """The options that give a process group made after the default one (a sub-group, a device mesh's
    groups) the run's --collective-timeout-s: torch's `new_group` without a timeout takes the backend's
    default (30 min under gloo, 10 under NCCL), not the default group's."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":  # NCCL wants its own options class
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return options
    from torch._C._distributed_c10d import Backend

    return Backend.Options(backend, timeout=timeout)


def timed_device_mesh(device: str, shape: tuple[int, ...], names: tuple[str, ...], timeout_s: float) -> object:
    """torch's `init_device_mesh` over the default group, every group of it made with `timeout_s` (a
    collective that waits on a peer gone fails after it, as the default group's do, rather than after
    torch's default). A dimension spanning every rank is the default group itself (made with the
    timeout: `CollectiveGroup`), as torch makes it without options."""
    from torch.distributed.device_mesh import init_device_mesh

    options = group_options(dist.get_backend(), timeout_s)
    world = dist.get_world_size()
    override = {name: options for name, n in zip(names, shape, strict=True) if n != world}
    return init_device_mesh(device, shape, mesh_dim_names=names, backend_override=override or None)


class CollectiveGroup:
    def __init__(
        self, rank: int, world_size: int, rendezvous: str, backend: str, timeout_s: float, link: Link | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.link = link or Link()  # the emulated network (--comm-delay-ms, --comm-bandwidth), see network.py
        timeout = timedelta(seconds=timeout_s)
        store = _HOSTED.pop(rendezvous, None)  # this process hosts the rendezvous (`host_rendezvous`)
        if store is None:  # another process hosts it; or rank 0 hosts it here, at an address chosen before
            host, port = rendezvous.rsplit(":", 1)  # (`free_address`), as torch's tcp:// init does
            store = dist.TCPStore(host, int(port), is_master=rank == 0, wait_for_workers=False, timeout=timeout)
        self.store = store  # the host's store serves the others as long as the group lives
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> float:
        """Average `tensor` across workers in place; returns the seconds it took."""
        t0 = time.perf_counter()
        if self.world_size > 1:
            done = self.link.reserve(ring_allreduce_bytes(tensor.numel() * tensor.element_size(), self.world_size), t0)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.world_size)
            self.link.hold_until(done)
        return time.perf_counter() - t0

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


FIRST_BUCKET_BYTES = 1024 * 1024  # as DDP: a small first bucket starts communication early
BUCKET_BYTES = 25 * 1024 * 1024
MIN_FIRST_BUCKET_BYTES = 64 * 1024


def first_bucket_cap(total_bytes: int) -> int:
    """The first bucket's size: DDP's 1 MiB, but at most a quarter of the whole gradient (and at least
    64 KiB). Under DDP's rule a gradient smaller than 1 MiB (the cnn's 0.6 MB, the char LM's 0.55 MB) is a
    single bucket, all-reduced only once backward is over; cut smaller, the last layers' gradients travel
    while backward computes the first layers' (benchmarks/RESULTS.md, issue 32)."""
    return max(MIN_FIRST_BUCKET_BYTES, min(FIRST_BUCKET_BYTES, total_bytes // 4))


class OverlappedAllReduce:
    """All-reduce the flat gradient buffer in buckets while backward is still running.

    The buffer is cut into contiguous buckets from its end (backward produces the last layers'
    gradients first), 25 MiB each after a first one of 1 MiB as DDP cuts them, or of a quarter of the
    gradient where that is less (`first_bucket_cap`), so that a small model's all-reduce overlaps too.
    A post-accumulate-grad hook on every parameter counts the bucket's gradients in; the bucket's
    all-reduce is launched (async) as soon as its last gradient has accumulated, so it overlaps the
    rest of backward.
    `finish()` launches any bucket whose parameters got no gradient this step (unused parameters
    never fire their hook, and waiting for them would hang), waits for all, and divides by N.
    Every rank builds the same buckets from the same model and launches them strictly in bucket
    order, so the collectives match; the price is that a bucket holding an unused parameter holds
    back the buckets after it until `finish()` (correct, just not overlapped).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        grads_flat: torch.Tensor,
        world_size: int,
        first_bucket_bytes: int | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        link: Link | None = None,
        weight: Callable[[], float] | None = None,
    ) -> None:
        self.grads_flat = grads_flat
        # This worker's gradient weight (heterogeneous shares, trainers/shares.py): each bucket is
        # multiplied by it just before its launch, as the gradient is complete there and not yet sent.
        self.weight = weight
        self.link = link or Link()  # each bucket is one emulated transfer, launched when the bucket is
        self.done = 0.0  # and the step's emulated transfers all complete by this time (perf_counter)
        self.world_size = world_size
        spans, offset = [], 0
        for p in params:
            spans.append((offset, offset + p.numel()))
            offset += p.numel()
        self.buckets: list[tuple[int, int]] = []
        bucket_of: dict[int, int] = {}
        if first_bucket_bytes is None:
            first_bucket_bytes = first_bucket_cap(offset * grads_flat.element_size())
        cap, hi, members = first_bucket_bytes, offset, []
        for i in range(len(params) - 1, -1, -1):
            members.append(i)
            lo = spans[i][0]
            if (hi - lo) * grads_flat.element_size() >= cap or i == 0:
                for m in members:
                    bucket_of[m] = len(self.buckets)
                self.buckets.append((lo, hi))
                hi, members, cap = lo, [], bucket_bytes
        self.needed = [0] * len(self.buckets)
        for b in bucket_of.values():
            self.needed[b] += 1
        self.ready = [0] * len(self.buckets)
        self.works: list[dist.Work] = []
        base = grads_flat.data_ptr()
        end = base + grads_flat.numel() * grads_flat.element_size()

        def on_grad(p: torch.nn.Parameter, b: int) -> None:
            if p.grad is None or not base <= p.grad.data_ptr() < end:
                raise RuntimeError("a gradient left the flat buffer; overlapped all-reduce cannot continue")
            self.ready[b] += 1
            # Launch strictly in bucket order, so every rank issues the same collectives in the same order.
            while self.next < len(self.buckets) and self.ready[self.next] == self.needed[self.next]:
                self._launch_next()

        self.handles = [
            p.register_post_accumulate_grad_hook(lambda p, b=bucket_of[i]: on_grad(p, b)) for i, p in enumerate(params)
        ]
        self.next = 0  # the next bucket to launch

    def _launch_next(self) -> None:
        lo, hi = self.buckets[self.next]
        weight = 1.0 if self.weight is None else self.weight()
        if weight != 1.0:
            self.grads_flat[lo:hi].mul_(weight)
        self.works.append(dist.all_reduce(self.grads_flat[lo:hi], op=dist.ReduceOp.SUM, async_op=True))
        if self.link.emulated:
            nbytes = ring_allreduce_bytes((hi - lo) * self.grads_flat.element_size(), self.world_size)
            self.done = self.link.reserve(nbytes)
        self.next += 1

    def finish(self) -> float:
        """Complete this step's all-reduce (mean in place); returns the seconds spent waiting here."""
        t0 = time.perf_counter()
        while self.next < len(self.buckets):  # buckets with an unused parameter, after backward
            self._launch_next()
        for work in self.works:
            work.wait()
        self.link.hold_until(self.done)  # what the emulated link has not delivered yet
        self.works.clear()
        self.ready = [0] * len(self.buckets)
        self.next = 0
        self.grads_flat.div_(self.world_size)
        return time.perf_counter() - t0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
