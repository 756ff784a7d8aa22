"""The shared-memory transport of ranks on one host ([Note: shared-memory collectives on one host]).

Every other engine test on this machine runs over it too (it is the default for gloo groups on one
host); these pin the transport itself: exact results against a reference at sizes around its
chunk boundaries, several collectives in flight on several groups mixed with gloo's own, the
switch back to gloo, a clear error when a rank never arrives, and nothing left in /dev/shm.
"""

from __future__ import annotations

import datetime
import glob
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from framework.distributed.fsdp import collectives as C
from framework.distributed.fsdp.host import set_host_transport, shm
from tests.distributed.harness import run_ranks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not shm.supported(), reason="the transport needs Linux on x86-64 with /dev/shm"),
]

REGION = 64 << 10  # small regions, so that modest tensors cross several chunks
# sizes (elements) around the chunk boundaries of REGION at 4 and 2 bytes, for 2 and 4 ranks
SIZES = [1, 7, 4096, 8191, 8192, 16385, 100_003]


def _segments() -> set:
    return set(glob.glob(os.path.join(shm.SHM_DIR, "fsdp-collectives-*")))


def _collectives_worker(rank, world, transport, dtypes):
    region = shm.REGION_BYTES
    shm.REGION_BYTES = REGION
    try:
        set_host_transport(transport)
        before = _segments()
        # the second group with a timeout of its own: its channel must take it (a hung rank on this
        # transport fails after trainer.collective_timeout_s, as on gloo)
        groups = [
            dist.new_group(list(range(world))),
            dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=42)),
        ]
        transports = [C.transport_for(g, torch.device("cpu")) for g in groups]
        stats = C.CommStats()
        errors = []
        for dtype in dtypes:
            for S in SIZES:
                gen = torch.Generator().manual_seed(S)
                shards = (torch.randn(world, S, generator=gen) * 100).to(dtype)
                fulls = torch.randn(world, world * S, generator=gen).to(dtype)
                # two gathers and two reductions in flight on two groups, and a gloo all-reduce among them
                outs = [torch.full((world * S,), -1, dtype=dtype) for _ in groups]
                reds = [torch.empty(S, dtype=dtype) for _ in groups]
                pend = [C.all_gather(o, shards[rank].clone(), t, stats, "t") for o, t in zip(outs, transports)]
                total = torch.tensor([float(rank)])
                dist.all_reduce(total)
                for red, t in zip(reds, transports):
                    k = t.scratch_numel(S)
                    scratch = torch.empty(k, dtype=dtype) if k else None
                    pend.append(C.reduce_scatter(red, fulls[rank].clone(), t, stats, "t", scratch))
                for p in pend:
                    C.wait(p)
                for o in outs:
                    if not torch.equal(o, shards.reshape(-1)):
                        errors.append(f"all-gather {dtype} {S}")
                # the reference sums in the transport's order: own chunk first, then rank order
                chunks = fulls.view(world, world, S)[:, rank]
                ref = chunks[rank].clone()
                for j in range(world):
                    if j != rank:
                        ref += chunks[j]
                for red in reds:
                    if transport == "shm" and not torch.equal(red, ref):
                        errors.append(f"reduce-scatter {dtype} {S}")
                    if transport == "gloo" and not torch.allclose(red.float(), ref.float(), rtol=1e-2, atol=1e-2):
                        errors.append(f"reduce-scatter (gloo) {dtype} {S}")
                if total.item() != world * (world - 1) / 2:
                    errors.append("gloo all-reduce")
        names = [t.name for t in transports]
        channels = [getattr(t, "channel", None) for t in transports]
        used = [c is not None and c.region_bytes == REGION for c in channels]
        sizes = [c._map.size() for c in channels if c is not None]
        timeouts = [c.timeout_s for c in channels if c is not None]
        return {
            "errors": errors,
            "names": names,
            "used": used,
            "left": sorted(_segments() - before),
            "sizes": sizes,
            "timeouts": timeouts,
        }
    finally:
        shm.REGION_BYTES = region


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_the_reference_exactly(world):
    results = run_ranks(_collectives_worker, world, args=("shm", [torch.float32, torch.bfloat16]), timeout_s=240)
    for rank, res in enumerate(results):
        assert res["errors"] == [], (rank, res["errors"])
        assert res["names"] == ["shm", "shm"], rank
        assert res["used"] == [True, True], rank  # both groups went through shared memory
        assert res["left"] == [], rank  # the segments were unlinked once mapped
        assert res["sizes"] == [4096 + 2 * world * REGION] * 2  # two slots of one region per rank
        # each group's own timeout: torch's default (30 minutes), and the 42 s the second was made with
        assert res["timeouts"] == [1800.0, 42.0]


def test_default_region_is_four_mib():
    assert shm.REGION_BYTES == 4 << 20  # docs/engine.md: 16 MiB a segment on two ranks
    assert shm.segment_bytes(2) == 4096 + (16 << 20)


def test_counters_of_many_ranks_stay_out_of_the_slots(tmp_path):
    """One cache line of counters per rank: past 64 ranks on a host they take more than a page."""
    path = str(tmp_path / "segment")
    channel = shm.SharedMemoryChannel.create(path, rank=0, world=100, region_bytes=4096)
    channel.unlink()
    assert channel._slots_at == 8192 and channel._map.size() == 8192 + 2 * 100 * 4096
    channel._region(0, 0, torch.uint8, 4096).fill_(7)  # the first region, right after the counters
    assert channel._counters.tolist() == [0] * 100 and channel._pids[0] > 0  # no counter was written over
    channel.close()


def test_host_transport_gloo_keeps_gloo():
    results = run_ranks(_collectives_worker, 2, args=("gloo", [torch.float32]), timeout_s=240)
    for res in results:
        assert res["errors"] == []
        assert res["names"] == ["gloo", "gloo"]
        assert res["used"] == [False, False]


def _fallback_worker(rank, world):
    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    if rank == 0:  # as when /dev/shm cannot hold the segment: every rank must take gloo
        shm.SharedMemoryChannel.create = no_space
    group = dist.new_group(list(range(world)))
    out = torch.empty(world * 5)
    transport = C.transport_for(group, torch.device("cpu"))
    C.wait(C.all_gather(out, torch.full((5,), float(rank)), transport, C.CommStats(), "t"))
    return out.tolist(), transport.name == "gloo"


def test_no_room_in_dev_shm_keeps_gloo():
    for out, on_gloo in run_ranks(_fallback_worker, 2, timeout_s=120):
        assert out == [0.0] * 5 + [1.0] * 5
        assert on_gloo


def test_a_segment_that_does_not_fit_is_refused_and_removed(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", no_space)
    path = str(tmp_path / "segment")
    with pytest.raises(OSError):
        shm.SharedMemoryChannel.create(path, rank=0, world=2, region_bytes=4096)
    assert not os.path.exists(path)


def test_a_rank_that_never_arrives_fails_with_a_message(tmp_path):
    path = str(tmp_path / "segment")
    channel = shm.SharedMemoryChannel.create(path, rank=0, world=2, region_bytes=4096, timeout_s=0.5)
    channel.unlink()
    out = torch.zeros(8)
    work = channel.all_gather(out, torch.ones(4))
    with pytest.raises(
        shm.SharedMemoryError,
        match=r"rank 0: collective timed out after 0.5 s: rank\(s\) \[1\] of this group did not reach",
    ):
        work.wait()
    with pytest.raises(shm.SharedMemoryError, match="an earlier collective on this group failed"):
        channel.reduce_scatter(torch.zeros(4), torch.ones(8)).wait()
    channel.close()


def test_a_rank_whose_process_exited_fails_within_seconds(tmp_path):
    path = str(tmp_path / "segment")
    channel = shm.SharedMemoryChannel.create(path, rank=0, world=2, region_bytes=4096, timeout_s=600)
    channel.unlink()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    channel._pids[1] = gone.pid  # what rank 1 writes when it maps the segment
    start = time.monotonic()
    with pytest.raises(shm.SharedMemoryError, match=rf"rank 1 of this group \(process {gone.pid}\) exited"):
        channel.all_gather(torch.zeros(8), torch.ones(4)).wait()
    assert time.monotonic() - start < 10  # not the 600 s timeout
    channel.close()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3))
        self.head = nn.Linear(32, 64)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _training_worker(rank, world, transport):
    from framework.distributed.fsdp import fully_shard, set_host_transport

    set_host_transport(transport)
    torch.manual_seed(0)
    model = _Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(4):
        idx = torch.randint(0, 64, (4, 16), generator=g)
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 64), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # plain numbers: tensors sent through the harness's queue would need this process alive
    return losses, [p.detach().reshape(-1).tolist() for p in model.parameters()]


def test_training_is_bit_identical_on_either_transport():
    """Two ranks: a gather moves bytes and a two-way sum is the same in either order, so the
    transport may not change a single bit of the training."""
    shm_runs = run_ranks(_training_worker, 2, args=("shm",), timeout_s=240)
    gloo_runs = run_ranks(_training_worker, 2, args=("gloo",), timeout_s=240)
    for (l1, p1), (l2, p2) in zip(shm_runs, gloo_runs):
        assert l1 == l2
        assert p1 == p2


def _tree_reduce_worker(rank, world, transport):
    from framework.distributed.fsdp.tree import tree_sum

    region = shm.REGION_BYTES
    shm.REGION_BYTES = REGION
    calls = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    try:
        set_host_transport(transport)
        t = C.transport_for(dist.new_group(list(range(world))), torch.device("cpu"))
        stats, errors = C.CommStats(), []
        for S in SIZES:
            gen = torch.Generator().manual_seed(S)
            # magnitudes spread over many binades: a sum in another order gives other bits
            fulls = torch.randn(world, world * S, generator=gen) * torch.exp(
                4 * torch.randn(world, world * S, generator=gen)
            )
            out = torch.full((S,), -1.0)
            C.wait(C.tree_reduce_scatter(out, fulls[rank].clone(), t, stats, "t"))
            ref = tree_sum(list(fulls.view(world, world, S)[:, rank].unbind()))
            if not torch.equal(out, ref):
                errors.append(S)
        sent = (world - 1) * sum(SIZES) * 4
        return {"name": t.name, "errors": errors, "gloo_calls": len(calls), "bytes": stats.alltoall_bytes == sent}
    finally:
        dist.all_to_all_single = real
        shm.REGION_BYTES = region


@pytest.mark.parametrize("world", [2, 3])
def test_tree_reduce_scatter_gives_the_tree_bits_on_either_transport(world):
    """The deterministic mode's reduction: the ranks' chunks added in the canonical tree's order,
    bit for bit, across chunk boundaries of the shared memory; on shared memory gloo's all-to-all is
    never called, and either transport counts an all-to-all's bytes."""
    for transport in ("shm", "gloo"):
        for rank, res in enumerate(run_ranks(_tree_reduce_worker, world, args=(transport,), timeout_s=240)):
            assert res["errors"] == [], (transport, rank, res["errors"])
            assert res["name"] == transport, rank
            assert res["gloo_calls"] == (0 if transport == "shm" else len(SIZES)), (transport, rank)
            assert res["bytes"], (transport, rank)
