"""Where the engine keeps its state: the groups, meshes and transports of a world are owned by one
object per world (`EngineGroups`, framework/distributed/fsdp/mesh.py), and go with their world."""

from __future__ import annotations

import gc
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed.harness import run_ranks


def _shm_workers() -> int:
    return sum(t.name.startswith("shm-collectives-") and t.is_alive() for t in threading.enumerate())


def _two_worlds(rank, world, store_file):
    """Shard and step a model, end the world, start another over the same ranks and do it again:
    the shared-memory transport's worker threads alive at each point."""
    from framework.distributed.fsdp import fully_shard
    from framework.distributed.fsdp.host import set_host_transport

    set_host_transport("shm")

    def shard_and_step():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        fully_shard(model)
        model(torch.ones(3, 4)).sum().backward()

    before = _shm_workers()
    shard_and_step()
    first = _shm_workers()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    shard_and_step()
    gc.collect()
    deadline = time.monotonic() + 10  # a closed worker ends once its queue is drained
    while _shm_workers() > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return before, first, _shm_workers()


def test_a_new_world_closes_the_old_worlds_transports(tmp_path):
    """A re-initialised world gets its own transports, and the old world's are closed: one
    shared-memory worker thread per group, not more with every world (they were kept, and their
    threads ran, until the process ended)."""
    from framework.distributed.fsdp.host import shm

    if not shm.supported():
        raise AssertionError("the shared-memory transport needs Linux on x86-64 with /dev/shm")
    for rank, counts in enumerate(run_ranks(_two_worlds, world_size=2, args=(str(tmp_path / "store"),))):
        assert counts == (0, 2, 2), (rank, counts)  # a shard group and its reduction twin
