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


# the objects a unit holds whose tensors the note names too (unit.reduction.accum, ...)
_PARTS = ("reduction", "codec")


def _note_names() -> set:
    """The attribute paths [Note: the buffers of a unit] names, below `unit.`: "shard",
    "reduction.accum", "ctx._pool", ..."""
    import re

    import framework.distributed.fsdp as fsdp

    note = fsdp.__doc__.split("[Note: the buffers of a unit]", 1)[1]
    return set(re.findall(r"\bunit\.(?!py\b)(\w+(?:\.\w+)*)", note))  # unit.py is a file


def _has_path(obj, path: str) -> bool:
    for name in path.split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def _tensor_paths(unit) -> set:
    """The attribute paths of `unit`, its reduction and its codec that hold tensors now."""
    held = {name for name, value in vars(unit).items() if _holds_tensors(value)}
    for part in _PARTS:
        held.update(f"{part}.{n}" for n, v in vars(getattr(unit, part)).items() if _holds_tensors(v))
    return held


def _holds_tensors(value) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    return isinstance(value, (torch.Tensor, torch.UntypedStorage))


def _unit_attributes(rank, world):
    """Train two micro-steps (the first without gradient sync) and a step on 2 ranks: the note's
    names missing from a unit or its context, and the unit attributes holding tensors at some
    point that the note does not name."""
    from framework.distributed.fsdp import fully_shard, sharded_units

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = _note_names()
    held = set()

    def look(*_):
        for u in sharded_units(model):
            held.update(_tensor_paths(u))

    for block in (model[2], model):
        block.register_forward_hook(look)
    x = torch.randn(3, 4)
    for sync in (False, True):
        model.set_requires_gradient_sync(sync)
        model(x).sum().backward()
        look()
    opt.step()
    look()
    units = sharded_units(model)
    missing = sorted({f"unit.{n}" for n in named for u in units if not _has_path(u, n)})
    return missing, sorted(held - named), sorted(named)


def test_the_buffer_glossary_names_real_attributes_and_every_tensor_a_unit_holds():
    """[Note: the buffers of a unit] (framework/distributed/fsdp/__init__.py) stays true: each
    attribute it names exists on a built unit (or its context), and each attribute of a unit that
    held a tensor during forward, backward (with and without gradient sync) and the optimizer step
    is named in it (the unit's own attributes and those of its reduction and codec)."""
    for rank, (missing, unnamed, named) in enumerate(run_ranks(_unit_attributes, world_size=2)):
        assert missing == [], (rank, missing)
        assert unnamed == [], (rank, unnamed)
        expected = {"shard", "reduction.grad_shard", "full_flat", "codec.send", "codec.secondary", "reduction.accum"}
        assert expected <= set(named), named
        assert "ctx._pool" in named, named
