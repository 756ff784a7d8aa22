"""Host transports: how process groups of CPU ranks move the engine's bulk collectives.

Everything the engine does only because it runs on CPUs lives in this package; the rest of the
engine sees a `Transport` ([Note: one transport per group] in transport.py). A CPU group on
gloo takes, in this order of preference:

- "shm" (the default): shared memory, when every rank of the group is on this host
  ([Note: shared-memory collectives on one host] in shm.py);
- "gloo": gloo's TCP, through in-place primitives ([Note: gloo collectives built from in-place
  primitives] in gloo.py); also where shared memory cannot be opened, or the group spans hosts.

`set_host_transport("gloo")` (`parallelism.host_transport=gloo`) skips shared memory for groups
whose transport has not been chosen yet.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..transport import Transport
from .gloo import GlooTransport
from .shm import open_shared_memory

HOST_TRANSPORTS = ("shm", "gloo")
# A job-wide choice, the same on every rank (parallelism.host_transport), read when a group's
# transport is chosen: per process on purpose, and rank threads of one process share it as they
# share the job's config; the transports it picks are kept per world (mesh.py's EngineGroups).
_preferred = ["shm"]


def set_host_transport(name: str) -> None:
    """Which transport CPU process groups on one host take when they are first used: "shm"
    (shared memory, the default) or "gloo". Set it the same on every rank, before the model's
    first forward."""
    if name not in HOST_TRANSPORTS:
        raise ValueError(f"host transport {name!r}: use one of {', '.join(HOST_TRANSPORTS)}")
    _preferred[0] = name


def group_timeout_s(group) -> float:
    """The timeout `group` was made with (`init_process_group`/`new_group(timeout=...)`, which
    `trainer.collective_timeout_s` sets); torch's default where the group does not say."""
    group = group if group is not None else dist.group.WORLD
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        return float(timeout.total_seconds())
    except (AttributeError, RuntimeError):  # torch keeps it on a private field: fall back, never fail
        return float(dist.default_pg_timeout.total_seconds())


def host_transport(group, device: torch.device) -> Optional[Transport]:
    """The host transport of `group` for tensors on `device`, or None where the group is not a
    CPU group (the default transport serves it). Collective over the group for "shm"."""
    if device.type != "cpu" or dist.get_backend(group) != "gloo":
        return None
    if _preferred[0] == "shm":
        found = open_shared_memory(group, group_timeout_s(group))
        if found is not None:
            return found
    return GlooTransport(group)
