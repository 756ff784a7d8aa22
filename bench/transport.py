"""How fast the engine's all-gather and reduce-scatter move data between the ranks of this host:
shared memory (the default) against gloo's TCP (`parallelism.host_transport=gloo`).

    .venv/bin/python bench/transport.py                 # 2 ranks, 4M-element fp32 shards
    .venv/bin/python bench/transport.py --ranks 4 --numel 1000000

Prints GB/s per rank: for an all-gather the bytes a rank receives, for a reduce-scatter the bytes
it sends ((N - 1) x shard bytes, as `comm_stats()` counts them), averaged over --iters calls after
two warm-up calls. The planner's CPU rate for shared memory (framework/planner/devices.py) is this
measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.local_ranks import run_local  # noqa: E402


def worker(rank: int, world: int, transport: str, numel: int, iters: int) -> tuple:
    from framework.distributed.fsdp import collectives as C
    from framework.distributed.fsdp import set_host_transport

    set_host_transport(transport)
    group = C.transport_for(dist.new_group(list(range(world))), torch.device("cpu"))
    stats = C.CommStats()
    out, shard = torch.empty(world * numel), torch.randn(numel)
    full, reduced = torch.randn(world * numel), torch.empty(numel)
    k = group.scratch_numel(numel)
    scratch = torch.empty(k) if k else None
    for _ in range(2):
        C.wait(C.all_gather(out, shard, group, stats, "bench"))
        C.wait(C.reduce_scatter(reduced, full, group, stats, "bench", scratch))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        C.wait(C.all_gather(out, shard, group, stats, "bench"))
    t1 = time.perf_counter()
    for _ in range(iters):
        C.wait(C.reduce_scatter(reduced, full, group, stats, "bench", scratch))
    t2 = time.perf_counter()
    moved = (world - 1) * numel * 4 / 1e9
    return moved * iters / (t1 - t0), moved * iters / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--numel", type=int, default=4_000_000, help="elements of one rank's fp32 shard")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    for transport in ("shm", "gloo"):
        res = run_local(worker, args.ranks, args=(transport, args.numel, args.iters), timeout_s=600)
        ag = ", ".join(f"{r[0]:.2f}" for r in res)
        rs = ", ".join(f"{r[1]:.2f}" for r in res)
        print(f"{transport:5s} all-gather GB/s per rank: {ag}; reduce-scatter GB/s per rank: {rs}")


if __name__ == "__main__":
    main()
