"""The process groups and device meshes the engine shards over, made once per world and kept by
the one object that owns them (`EngineGroups`); groups are created by every rank, in the same order.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from framework.distributed.groups import init_mesh, new_group


class EngineGroups:
    """Everything the engine made in one world (one default process group) to communicate:
    meshes, process groups and their transports, each made once (creating a group is collective)
    and found again by the ranks or mesh it serves. A re-initialised world gets a fresh one; the
    old one closes its transports as it goes, and its groups and meshes go with it. Meshes are
    found by `mesh_key`, their content, not their identity: slicing a mesh makes a new object over
    the same groups."""

    def __init__(self, world: dist.ProcessGroup):
        self.world = weakref.ref(world)
        self.default_mesh: Dict[str, DeviceMesh] = {}  # device type -> the 1-D mesh over the world
        self.tp_of_dp: Dict[tuple, DeviceMesh] = {}  # dp mesh -> the tp mesh seen with it (blocks first)
        self.state_mesh: Dict[tuple, DeviceMesh] = {}  # (dp mesh, tp mesh) -> the checkpoint's mesh
        self.groups: Dict[Tuple[int, ...], dist.ProcessGroup] = {}  # ranks -> their group (hpZ)
        self.rows: Dict[tuple, List[Tuple[int, ...]]] = {}  # mesh -> every shard row of the world
        self.reduce_groups: Dict[tuple, dist.ProcessGroup] = {}  # mesh -> this rank's reduction twin
        # id(group) -> (a weak reference to the group, {device type: its transport}): see
        # collectives.transport_for and [Note: one transport per group] in transport.py
        self.transports: Dict[int, Tuple[weakref.ref, Dict[str, Any]]] = {}
        weakref.finalize(self, _close_transports, self.transports)


def _close_transports(transports: Dict[int, Tuple[weakref.ref, Dict[str, Any]]]) -> None:
    for _, by_device in transports.values():
        for transport in by_device.values():
            transport.close()
    transports.clear()


# [Note: engine state per world, not per process]
# A world is a default process group; usually a process has one at a time, but ranks may also be
# threads of one process, each with its own default group (torch's threaded process group, which
# its FSDP2 tests use), so `EngineGroups` are kept per world group, never in one module-level slot:
# with one slot, two rank threads replaced each other's, one rank made its reduction group again
# (a collective the other never joined) and both waited for good. `_worlds` holds every world's in
# use, looked up under a lock (ranks of one process make theirs at the same time). A world is let go
# when the thread that used it sees another world (its own was destroyed: a re-initialised world
# closes the old one's transports) or when the world group itself has gone. Everything an
# `EngineGroups` holds is created by its own world's ranks only, in the same order on each.
_worlds: Dict[int, EngineGroups] = {}  # id(world group) -> its EngineGroups
_worlds_lock = threading.Lock()
_last_world = threading.local()  # .key: id() of the world this thread used last


def engine_groups() -> EngineGroups:
    """The current world's `EngineGroups` (made on first use after the world was initialised);
    see [Note: engine state per world, not per process]."""
    world = dist.group.WORLD
    key = id(world)
    with _worlds_lock:
        found = _worlds.get(key)
        if found is None or found.world() is not world:
            for k in [k for k, e in _worlds.items() if e.world() is None]:
                del _worlds[k]  # its world group is gone; the finalizer closes its transports
            found = _worlds[key] = EngineGroups(world)
        last = getattr(_last_world, "key", None)
        if last != key:
            if last is not None:
                _worlds.pop(last, None)  # this thread's earlier world was destroyed
            _last_world.key = key
    return found


def mesh_key(mesh: DeviceMesh) -> tuple:
    # the shape too: a 1-D mesh over 4 ranks and an unnamed 2 x 2 one list the same ranks, and
    # sharing their cached rows and reduction group crashed the 2 x 2 one's first reduce-scatter
    return (tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)


def dp_tp_mesh(dp: DeviceMesh, tp: DeviceMesh) -> DeviceMesh:
    """The (dp..., tp) mesh for checkpoint DTensors, built from the existing groups (collective once).

    2-D (dp_shard, tp) for a 1-D dp mesh, 3-D (dp_replicate, dp_shard, tp) for hybrid sharding.
    """
    key, made = mesh_key(dp) + mesh_key(tp), engine_groups().state_mesh
    if key not in made:
        seen = [None] * dist.get_world_size()
        mine = tuple(dp.get_local_rank(d) for d in range(dp.ndim)) + (tp.get_local_rank(0),)
        dist.all_gather_object(seen, (mine, dp.mesh.flatten().tolist(), tp.mesh.flatten().tolist()))
        grid = torch.empty(*dp.mesh.shape, tp.size(), dtype=torch.int64)
        for rank in _connected(seen, dist.get_rank()):  # the ranks of this (dp x tp) block only
            grid[seen[rank][0]] = rank
        dp_names = dp.mesh_dim_names or (("dp",) if dp.ndim == 1 else ("dp_replicate", "dp_shard"))
        names = tuple(dp_names) + ((tp.mesh_dim_names or ("tp",))[0],)
        groups = [dp.get_group(d) for d in range(dp.ndim)] + [tp.get_group(0)]
        made[key] = DeviceMesh.from_group(groups, dp.device_type, mesh=grid, mesh_dim_names=names)
    return made[key]


def _connected(seen: list, me: int) -> List[int]:
    """The ranks sharing a dp or tp group with `me`, transitively: this rank's (dp x tp) block when
    the meshes cover only part of the world (a pipeline stage of a pp x dp x tp mesh).
    `seen[r]` is rank r's (coordinates, dp ranks, tp ranks)."""
    block, todo = {me}, [me]
    while todo:
        r = todo.pop()
        for other in seen[r][1] + seen[r][2]:
            if other not in block:
                block.add(other)
                todo.append(other)
    return sorted(block)


def _shard_rows(mesh: DeviceMesh) -> List[Tuple[int, ...]]:
    """Every shard group of the world that `mesh` belongs to, as sorted rank tuples: the same
    list on every rank. A mesh over part of the world (the dp dims beside tensor parallel) shows
    each rank only its own rows, so the rows are gathered from all ranks (collective, once)."""
    key, made = mesh_key(mesh), engine_groups().rows
    if key not in made:
        rows = [tuple(r) for r in mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()]
        if mesh.size() != dist.get_world_size():
            seen: List[Optional[list]] = [None] * dist.get_world_size()
            dist.all_gather_object(seen, rows)
            rows = [tuple(r) for rs in seen for r in rs]
        made[key] = sorted(set(rows))
    return made[key]


def secondary_blocks(rows: Sequence[Sequence[int]], k: int) -> List[Tuple[int, ...]]:
    """hpZ: the groups of k consecutive ranks of each shard row, in creation order (every rank
    must create every group, in this order; `rows` must be the whole world's, see _shard_rows)."""
    return [tuple(row[i : i + k]) for row in sorted(tuple(r) for r in rows) for i in range(0, len(row), k)]


def _groups_for(blocks: List[Tuple[int, ...]]) -> Dict[Tuple[int, ...], dist.ProcessGroup]:
    """One group per rank tuple, created by every rank in the given order (cached per tuple)."""
    made = engine_groups().groups
    for ranks in blocks:
        if ranks not in made:
            made[ranks] = new_group(ranks)
    return {ranks: made[ranks] for ranks in blocks}


def secondary_group(mesh: DeviceMesh, k: int):
    """hpZ: (the group of k consecutive ranks of this rank's shard row, k, this rank's index in it)."""
    me = dist.get_rank()
    groups = _groups_for(secondary_blocks(_shard_rows(mesh), k))
    mine = next(r for r in groups if me in r)
    return groups[mine], k, mine.index(me)


def reduce_group(mesh: DeviceMesh, shard_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The twin of this rank's shard group that gradient reductions use ([Note: reductions in a
    fixed order on their own group] in context.py); one per shard row, made on first use."""
    if dist.get_world_size(shard_group) == 1:
        return shard_group
    key, made = mesh_key(mesh), engine_groups().reduce_groups
    if key not in made:
        me = dist.get_rank()
        rows = _shard_rows(mesh)
        twins = [new_group(ranks) for ranks in rows]  # a twin: a second group, same ranks
        made[key] = next(g for r, g in zip(rows, twins) if me in r)
    return made[key]


def resolve_mesh(mesh: Optional[DeviceMesh], device: torch.device, tp_mesh: Optional[DeviceMesh] = None):
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialised process group: call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    if mesh is None:
        if device.type == "meta":  # built on meta, materialised later with to_empty
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        made = engine_groups().default_mesh
        if device.type not in made:
            made[device.type] = init_mesh(device.type, (world,))
        mesh = made[device.type]
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh has {mesh.ndim} dims {mesh.mesh_dim_names}; pass a 1-D mesh (shard) or a "
            f"2-D mesh (replicate, shard) for hybrid sharding, e.g. mesh['dp_replicate', 'dp_shard']"
        )
    if world % mesh.size() != 0:
        raise ValueError(
            f"fully_shard: mesh size {mesh.size()} does not divide world size {world}; build the mesh over all ranks"
        )
    # A dp mesh may cover part of the world, as in FSDP2: the dp dims of a (pp, dp, tp) mesh hold
    # one pipeline stage's ranks. Every group is made from all ranks' rows (_shard_rows), so each
    # stage shards and reduces within its own ranks.
    if tp_mesh is not None:
        # [Note: tensor parallel composition] holds for a 2-D (replicate, shard) dp mesh as for a
        # 1-D one: the TP-local tensors are sharded over the shard dim, their gradients
        # reduce-scattered there and all-reduced over the replicate dim like plain parameters.
        if world % (mesh.size() * tp_mesh.size()):
            raise ValueError(
                f"fully_shard: dp mesh size {mesh.size()} x tp mesh size {tp_mesh.size()} does not divide world size "
                f"{world}; pass the dp dimension of the same mesh the tensor parallel plan used"
            )
        engine_groups().tp_of_dp[mesh_key(mesh)] = tp_mesh
    elif mesh.size() != world:
        tp_mesh = engine_groups().tp_of_dp.get(mesh_key(mesh))  # the root of a TP model: its blocks named the tp mesh
    if mesh.ndim == 1:
        return mesh, mesh.get_group(0), None, tp_mesh
    return mesh, mesh.get_group(1), mesh.get_group(0), tp_mesh
