"""Process groups and device meshes made with the job's collective timeout.

[Note: one timeout for every group]
`trainer.collective_timeout_s` is given to `init_process_group`; torch gives a group made later
without a timeout (`new_group`, the groups of `init_device_mesh` and `DeviceMesh._flatten`) its
module default instead (30 minutes on gloo, 10 on NCCL), so a hung rank would end the job after
the job's timeout when the others wait in a world collective and after 30 minutes when they wait
in a sub-group's. Every group the framework makes therefore passes the world group's own timeout
(`new_group`), and its meshes are built from such groups (`init_mesh`, `flatten`) with
`DeviceMesh.from_group`. Torch's module defaults are left as they are: a program that imports us
gets the torch it expects.

[Note: flattened dims stay in their mesh]
Under tensor parallelism a weight is a DTensor on the mesh's `tp` dim, and torch's `fully_shard`
joins its data-parallel mesh and that `tp` mesh into one (`DeviceMesh._concatenate`), which it
does only for meshes sliced from the same root mesh. A data-parallel mesh that flattens dims of
the root (dp_shard x cp under context parallelism) is therefore made by the root's own
`_flatten`, given the world group's backend options (and so the job's timeout), not as a fresh
mesh over the same ranks: `engine=torch` with tp and cp crashed in the ranks with a fresh one.
"""

from __future__ import annotations

import datetime
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_DEFAULT_S = 1800.0  # torch's own default for gloo, where a group does not say


def job_timeout() -> datetime.timedelta:
    """The timeout the world group was made with (`trainer.collective_timeout_s`)."""
    return datetime.timedelta(seconds=timeout_s(dist.group.WORLD))


def timeout_s(group) -> float:
    """The timeout `group` was made with; torch's gloo default where the group does not say."""
    group = group if group is not None else dist.group.WORLD
    try:
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):  # kept on a private field: fall back, never fail
        return _DEFAULT_S


def new_group(ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None):
    """`dist.new_group` with the job's timeout (collective: every rank, in the same order)."""
    return dist.new_group(list(ranks) if ranks is not None else None, backend=backend, timeout=job_timeout())


_made: Dict[Tuple[int, ...], dist.ProcessGroup] = {}  # ranks -> the group init_mesh made, per world


def _group_of(ranks: Tuple[int, ...]):
    """The group over `ranks` (the world group for all of them), made once per world."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    key = (id(dist.group.WORLD), *ranks)
    if key not in _made:
        _made[key] = new_group(ranks)
    return _made[key]


def _mesh_from(grid: torch.Tensor, device_type: str, names):
    """A DeviceMesh over `grid` (rank ids), each dim's groups made with the job's timeout: every
    rank makes every group of every dim, in the same order, and keeps its own."""
    from torch.distributed.device_mesh import DeviceMesh

    me, mine = dist.get_rank(), []
    for dim in range(grid.ndim):
        rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()
        for row in rows:
            group = _group_of(tuple(row))
            if me in row:
                mine.append(group)
    # A 1-D mesh from its one group (torch's list form asks for names, which a default mesh has not).
    return DeviceMesh.from_group(mine[0] if grid.ndim == 1 else mine, device_type, mesh=grid, mesh_dim_names=names)


def init_mesh(device_type: str, shape: Sequence[int], mesh_dim_names: Optional[Sequence[str]] = None):
    """`init_device_mesh(device_type, shape, mesh_dim_names=...)` over the whole world, with groups
    made with the job's timeout ([Note: one timeout for every group])."""
    grid = torch.arange(dist.get_world_size(), dtype=torch.int64).reshape(*shape)
    names = tuple(mesh_dim_names) if mesh_dim_names else None
    return _mesh_from(grid, device_type, names)


def _job_options(device_type: str):
    """Backend options of the world group's backend type carrying the job's timeout, for the groups
    torch makes when it flattens a mesh's dims (torch passes their `_timeout` to `new_group`)."""
    options = type(dist.group.WORLD._get_backend(torch.device(device_type)).options)()
    options._timeout = job_timeout()
    return options


def flatten(mesh, name: str):
    """The 1-D mesh over all the ranks of `mesh` (a slice of a larger named mesh, e.g. dp_shard x
    cp), named `name`: `mesh._flatten(name)`, its groups made with the job's timeout. It stays a
    mesh of the same root (see [Note: flattened dims stay in their mesh])."""
    return mesh._flatten(name, backend_override=_job_options(mesh.device_type))


def replicate_and_flat(mesh, replicate: str, flat: Sequence[str], name: str):
    """The 2-D mesh (`replicate`, the dims `flat` flattened as `name`) of this rank, cut from the
    whole named `mesh` (e.g. hybrid sharding under context parallelism: (dp_replicate, dp_shard x
    cp)), with groups made with the job's timeout; a mesh of the same root as `flatten`'s."""
    flatten(mesh[tuple(flat)], name)
    return mesh[replicate, name]
