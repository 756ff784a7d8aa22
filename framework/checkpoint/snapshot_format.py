"""What one rank's in-memory snapshot holds, and its check before any byte of it is used: the
tensors as the engine keeps them, the train state, the RNG, and the manifest that indexes them
(framework/checkpoint/memory.py takes and restores snapshots with it)."""

from __future__ import annotations

import hashlib
import json
from typing import List, Tuple

import torch

from framework.checkpoint.contents import rng_state, set_rng_state

FORMAT = 1
MANIFEST_LIMIT = 64 << 20  # bytes: a manifest is the tensors' index and a few KB of state


class SnapshotRefused(Exception):
    """A segment that is not whole, not ours, or not of this job's layout."""


# [Note: a snapshot is the engine's own shards]
# A disk checkpoint goes through the engine's state dicts (get_state_dicts / set_state_dicts): a
# layout any world size and either engine can load, built with collectives (0.5 s a call for the
# benchmark GPT on 2 CPU ranks, more than a step's tenth). A snapshot is restored only into the
# same job (same world size, engine and model: the manifest and the tensor index are checked), so
# it holds each rank's tensors as the engine itself keeps them: every parameter's local shard, its
# optimizer state and the module buffers, copied as they are. A restarted process has no optimizer
# state yet: the engine's get_state_dicts makes it (a zero-lr step, as for a disk load), and the
# snapshot's bytes are then copied over it, in place, once every rank has found its own whole.


def local_part(t):
    return t.to_local() if hasattr(t, "to_local") else t


def own_tensors(model, optimizer) -> Tuple[List[Tuple[list, torch.Tensor]], List[list]]:
    """([(path, tensor)], [[path, plain value]]): this rank's parameters, buffers and optimizer
    state as the engine holds them (its local shards: no copies, no collectives), in a fixed order.
    See [Note: a snapshot is the engine's own shards]."""
    tensors, leaves = [], []
    for name, p in model.named_parameters():
        tensors.append((["param", name], p))
        st = optimizer.state.get(p, {})
        for key in sorted(st, key=str):
            value = st[key]
            if isinstance(value, torch.Tensor):
                tensors.append((["optim", name, str(key)], value))
            else:
                leaves.append([["optim", name, str(key)], value])
    for name, b in model.named_buffers():
        tensors.append((["buffer", name], b))
    return tensors, leaves


def _plain(value) -> bool:
    return (
        value is None
        or isinstance(value, (bool, int, float, str))
        or (isinstance(value, (list, tuple)) and all(_plain(v) for v in value))
    )


def _groups(optimizer) -> list:
    """The optimizer's hyper-parameters per group (lr, betas, ...: what the LR schedule and the
    optimizer change between steps), as JSON."""
    return [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _plain(v)}
        for g in optimizer.param_groups
    ]


def manifest_head(state, job: str, rank: int, world: int, leaves: list) -> dict:
    """Everything of a manifest but the tensors' index: who wrote it, the step, the train state,
    the RNG states, and the optimizer's state that is not a tensor (`leaves`)."""
    return {
        "format": FORMAT,
        "job": job,
        "rank": rank,
        "world_size": world,
        "step": state.step,
        "train_state": {
            "scheduler": state.scheduler.state_dict(),
            "train_loader": state.train_loader.state_dict(),
            "optimizer_param_groups": _groups(state.optimizer),
        },
        "rng": rng_state(),
        "leaves": leaves,
    }


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotRefused(f"unknown dtype {name!r}")
    return dtype


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def parse(raw: bytes, data: bytearray, where: str, targets: list, job: str, rank: int, world: int):
    """(manifest, [(target tensor, offset, bytes)], data) of a segment's manifest and data bytes,
    checked against this rank's tensors (`targets`, from `own_tensors`); SnapshotRefused if it is
    not whole or not rank `rank`'s of job `job` on `world` ranks. Nothing is written yet (see
    `apply`), and no collectives: a refusal is this rank's alone."""
    manifest = None
    try:
        manifest = json.loads(raw)
        ok = (
            len(raw) <= MANIFEST_LIMIT
            and manifest["format"] == FORMAT
            and manifest["job"] == job
            and manifest["rank"] == rank
            and manifest["world_size"] == world
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise SnapshotRefused(
            f"step {manifest.get('step') if isinstance(manifest, dict) else '?'}: not a "
            f"snapshot manifest of this job and rank {rank}"
        )
    if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SnapshotRefused(f"{where}: its bytes do not match its manifest's sha256 (torn or corrupted)")
    index = manifest["tensors"]
    if [p for p, *_ in index] != [p for p, _ in targets]:
        raise SnapshotRefused(f"{where}: holds other tensors than this job's model and optimizer")
    copies = []
    for (path, dtype, shape, offset, nbytes), (_, target) in zip(index, targets):
        local = local_part(target)
        if _dtype(dtype) != local.dtype or list(local.shape) != shape or nbytes != local.numel() * local.element_size():
            raise SnapshotRefused(f"{where}: {'/'.join(path)} is {dtype}{shape}, this job's {local.dtype}")
        if offset < 0 or offset + nbytes > len(data):
            raise SnapshotRefused(f"{where}: {'/'.join(path)} lies outside the data")
        copies.append((local, offset, nbytes))
    return manifest, copies, data


def apply(state, manifest: dict, copies: list, data: bytearray) -> None:
    """Every rank found its own whole: the bytes go over the live tensors, then the rest."""
    with torch.no_grad():
        for local, offset, nbytes in copies:
            if nbytes:
                src = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=nbytes)
                local.copy_(src.view(local.dtype).view(local.shape))
    params = dict(state.model.named_parameters())
    for path, value in manifest["leaves"]:
        if path[0] == "optim":
            state.optimizer.state[params[path[1]]][path[2]] = value
    saved = manifest["train_state"]
    for group, hyper in zip(state.optimizer.param_groups, saved["optimizer_param_groups"]):
        group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in hyper.items()})
    state.scheduler.load_state_dict(saved["scheduler"])
    state.train_loader.load_state_dict(saved["train_loader"])
    set_rng_state(manifest["rng"])
