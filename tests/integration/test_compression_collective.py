"""`CompressedAllReduce` on a real 2-rank gloo group: what each codec reduces to, the bytes it counts, the
emulated link it charges, and PowerSGD against PyTorch's own DDP hook."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_two_rank_script

pytestmark = pytest.mark.integration  # real torch.distributed ranks

CODECS_SCRIPT = textwrap.dedent(
    """
    import math
    import sys
    import time

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from distrain.compression import parse_codec
    from distrain.compression.powersgd import PowerSGDCodec
    from distrain.strategies.compressed_collective import CompressedAllReduce
    from distrain.strategies.network import Link

    SHAPES = [torch.Size([16, 20]), torch.Size([16]), torch.Size([4, 16]), torch.Size([4]), torch.Size([3, 2, 5])]
    N = sum(s.numel() for s in SHAPES)  # 474


    def data(rank, step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(N, generator=g) * (1 + 3 * rank)


    def gathered(t):
        out = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(out, t)
        return out


    def check(rank, text, expected_bytes, exact):
        spec = parse_codec(text)
        reducer = CompressedAllReduce(spec, 2, N, shapes=SHAPES if spec.needs_shapes else None)
        own = CompressedAllReduce(spec, 1, N, shapes=SHAPES if spec.needs_shapes else None)  # this rank alone
        for step in range(3):
            x = data(rank, step)
            buffer = x.clone()
            before = reducer.residual.clone()
            sent = reducer.all_reduce_mean_(buffer)
            assert sent == expected_bytes, (text, sent, expected_bytes)
            assert reducer.last_raw_bytes == N * 4  # a ring all-reduce of fp32 at P = 2: 2(P-1)/P = 1
            a, b = gathered(buffer)
            assert torch.equal(a, b), text  # every rank holds the same result
            xs = gathered(x)
            mean = (xs[0] + xs[1]) / 2
            if exact == "mean":
                assert torch.allclose(buffer, mean, rtol=1e-4, atol=1e-4), (text, (buffer - mean).abs().max())
            elif exact == "cast":
                dtype = torch.float16 if text == "fp16" else torch.bfloat16
                eps = torch.finfo(dtype).eps
                bound = 2 * eps * (xs[0].abs() + xs[1].abs()) / 2  # two roundings of each term and the sum
                assert torch.all((buffer - mean).abs() <= bound + 1e-7), text
                assert not torch.equal(buffer, mean)
            elif exact == "lowrank":  # PowerSGD below full rank: an approximate mean, error feedback as the hook's
                assert torch.allclose(reducer.residual, x + before - buffer, atol=1e-5)
                assert 0 < (buffer - mean).norm() < mean.norm()
            else:  # the mean of each rank's decoded values (error feedback included, on the rank's own stream)
                decoded = x.clone()
                own.all_reduce_mean_(decoded)  # the same codec and residual history, without peers
                d0, d1 = gathered(decoded)
                assert torch.allclose(buffer, (d0 + d1) / 2, atol=1e-6), text
                assert torch.equal(reducer.residual, own.residual), text
                assert reducer.residual.abs().max() > 0
                assert not torch.allclose(buffer, mean, atol=1e-3)  # lossy indeed


    def rank_main(rank, port):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        k = math.ceil(0.05 * N)
        matrices = 2 * (16 + 20) + 2 * (4 + 16) + 2 * (3 + 10)  # r(m + n), r = 2
        # P = 2: a ring all-reduce sends 2(P-1)/P = 1 x its payload; an all-gather (P-1) = 1 x.
        check(rank, "fp16", N * 2, "cast")
        check(rank, "bf16", N * 2, "cast")
        check(rank, "int8", N + 4 * math.ceil(N / 1024), "decoded")
        check(rank, "topk:0.05", 8 * k, "decoded")
        # At rank >= min(m, n), P and Q would take more bytes than M: everything goes as fp32, exactly.
        check(rank, "powersgd:64", 4 * N, "mean")
        # Compressed at any cost (min_compression_rate 0), P·Qᵀ at rank min(m, n) is the exact mean too.
        spec = parse_codec("powersgd:64")
        reducer = CompressedAllReduce(spec, 2, N, shapes=SHAPES)
        reducer.codec = PowerSGDCodec(spec, SHAPES, min_compression_rate=0)
        full = 16 * (16 + 20) + 4 * (4 + 16) + 3 * (3 + 10)  # r'(m + n), r' = min(m, n)
        for step in range(3):
            x = data(rank, step)
            buffer = x.clone()
            assert reducer.all_reduce_mean_(buffer) == 4 * (full + 20)
            xs = gathered(x)
            assert torch.allclose(buffer, (xs[0] + xs[1]) / 2, rtol=1e-4, atol=1e-4)
        check(rank, "powersgd:2", 4 * (matrices + 20), "lowrank")

        # The link: every transfer waits latency + bytes / rate; PowerSGD makes three (vectors, P, Q).
        for text, transfers in (("fp16", 1), ("int8", 1), ("powersgd:2", 3)):
            spec = parse_codec(text)
            link = Link(latency_s=0.05, bytes_per_s=10_000.0)
            reducer = CompressedAllReduce(spec, 2, N, shapes=SHAPES if spec.needs_shapes else None, link=link)
            dist.barrier()
            t0 = time.perf_counter()
            sent = reducer.all_reduce_mean_(data(rank, 9))
            took = time.perf_counter() - t0
            assert took >= transfers * 0.05 + sent / 10_000.0, (text, took, sent)
            assert link.busy_until >= t0 + transfers * 0.05 + sent / 10_000.0
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        # Forked, not spawned: the ranks start with torch and distrain already imported (a spawned rank
        # imports them again); nothing has run a torch op before.
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True, start_method="fork")
        print("OK")
    """
)


def test_each_codec_reduces_counts_and_charges_its_bytes(tmp_path):
    run_two_rank_script(tmp_path, "codecs.py", CODECS_SCRIPT)


HOOK_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    from distrain.compression import CodecSpec
    from distrain.strategies.compressed_collective import CompressedAllReduce

    START, STEPS = 2, 6


    def hook_run(rank, r):
        '''Train DDP under PyTorch's PowerSGD hook; record each step's bucket before and after the hook.'''
        torch.manual_seed(0)  # the same replica on both ranks
        model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))
        ddp = DistributedDataParallel(model)
        state = PowerSGDState(
            process_group=None,
            matrix_approximation_rank=r,
            start_powerSGD_iter=START,
            min_compression_rate=1,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,  # CompressedAllReduce's seed
        )
        records = []

        def recording_hook(state, bucket):
            before = bucket.buffer().clone()
            shapes = [g.shape for g in bucket.gradients()]
            return powerSGD_hook(state, bucket).then(
                lambda fut: records.append((before, shapes, fut.value().clone())) or fut.value()
            )

        ddp.register_comm_hook(state, recording_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)
        for _ in range(STEPS):
            optimizer.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
        assert len(records) == STEPS  # one bucket a step
        return records


    def rank_main(rank, port):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        for r in (2, 3):  # Gram-Schmidt (r <= 2) and QR (r > 2) orthonormalisation
            records = hook_run(rank, r)
            shapes = records[START][1]
            assert sorted(len(s) for s in shapes) == [1, 1, 2, 2]
            ours = CompressedAllReduce(CodecSpec("powersgd", rank=r), 2, records[START][0].numel(), shapes=shapes)
            lossy = False
            for before, step_shapes, theirs in records[START:]:
                assert step_shapes == shapes
                buffer = before.clone()
                ours.all_reduce_mean_(buffer)
                assert torch.allclose(buffer, theirs, rtol=1e-4, atol=1e-6), (r, (buffer - theirs).abs().max())
                exact = before.clone()
                dist.all_reduce(exact)
                lossy |= not torch.allclose(theirs, exact / 2, atol=1e-4)
            assert lossy  # the comparison is of compressed results, not of exact means
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        # Forked, not spawned: the ranks start with torch and distrain already imported (a spawned rank
        # imports them again); nothing has run a torch op before.
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=2, join=True, start_method="fork")
        print("OK")
    """
)


def test_powersgd_equals_pytorchs_ddp_hook(tmp_path):
    """DDP over gloo on 2 ranks with `powerSGD_hook` (error feedback, warm start, seed 0), from the step it
    starts compressing (`start_powerSGD_iter=2`): ours, fed each step's same bucket, gives the hook's
    reduced gradients. `min_compression_rate=1` (not 0) so the hook, like ours, leaves the biases
    uncompressed: with 0 it would compress a 1-D tensor as an n x 1 matrix."""
    run_two_rank_script(tmp_path, "hook.py", HOOK_SCRIPT)


GROUP_SCRIPT = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from distrain.config import RunConfig
    from distrain.strategies.base import StrategyContext
    from distrain.strategies.channel import Channel

    SHAPES = [torch.Size([6, 5]), torch.Size([6]), torch.Size([3, 4])]
    N = sum(s.numel() for s in SHAPES)  # 48


    def data(rank, step):
        return torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + step)) * (1 + rank)


    def rank_main(rank, port):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        # Two groups of two, as a cut replica's "replicate" groups at R = 2 x D = 2: {0, 2} and {1, 3}.
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        peer = (rank + 2) % 4
        everyone = [data(r, 0) for r in range(4)]
        pair = (everyone[rank] + everyone[peer]) / 2  # the mean over this rank's group only
        scale = max(everyone[rank].abs().max(), everyone[peer].abs().max())
        # (codec, how far from the group's mean it may end): topk:1 and powersgd at full rank lose nothing;
        # fp16 rounds, int8 within a step of its scale; rank-2 PowerSGD is a low-rank mean (None: unbounded).
        cases = [("topk:1", 1e-6), ("powersgd:8", 1e-5), (None, 1e-6), ("fp16", 2e-3 * scale), ("int8", scale / 127)]
        for codec, bound in [*cases, ("powersgd:2", None)]:
            ch = Channel(RunConfig(compress=codec), StrategyContext(rank=rank, world_size=4, device="cpu"))
            ch.group = SimpleNamespace(world_size=4)  # the default group is the run's four
            ch.open("grads", shapes=SHAPES, group=mine)
            x = everyone[rank].clone()
            traffic = ch.all_reduce("grads", x)
            if bound is not None:
                assert (x - pair).abs().max() <= bound, (codec, (x - pair).abs().max())
            others = [torch.empty_like(x) for _ in range(4)]
            dist.all_gather(others, x)
            assert torch.equal(others[rank], others[peer]) and not torch.equal(others[rank], others[(rank + 1) % 4])
            if codec is None:
                assert traffic.uncompressed is None and traffic.sent == 4 * N  # a ring over P = 2: 1 x payload
            else:
                assert traffic.uncompressed == 4 * N and ch.streams["grads"].reducer.world_size == 2, codec
                if codec == "topk:1":
                    assert traffic.sent == 8 * N  # values and indices, all-gathered with one peer
            # An exact tail goes float32 over the same group.
            y = everyone[rank].clone()
            ch.open("params", shapes=SHAPES[:2], group=mine)
            ch.all_reduce("params", y, exact_tail=12)
            assert torch.allclose(y[-12:], pair[-12:], atol=1e-6)
        dist.barrier()
        dist.destroy_process_group()


    if __name__ == "__main__":
        mp.start_processes(rank_main, args=(int(sys.argv[1]),), nprocs=4, join=True, start_method="fork")
        print("OK")
    """
)


def test_a_stream_opened_over_a_group_reduces_within_it_under_every_kind_of_codec(tmp_path):
    """Four gloo ranks in two groups of two (a cut replica's "replicate" groups): a channel stream opened
    over its group averages within that group under a gather codec (topk:1, lossless: the group's mean
    exactly), a summed one (fp16), PowerSGD's rounds and float32, counting P = 2's bytes, and an exact
    tail travels float32 over the same group."""
    run_two_rank_script(tmp_path, "groups.py", GROUP_SCRIPT)
