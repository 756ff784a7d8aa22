"""Whole matrices for optimizers that need them (Muon, Shampoo): `map_whole`.

[Note: whole matrices from pieces]
An optimizer step that transforms each matrix as a whole (Muon's Newton-Schulz orthogonalization)
gets, from `ShardPiece.map_whole(updates, fn)`, this rank's piece of `fn(full matrix)` for each
update piece, computed where the matrix is whole:
  * a matrix whose range in its unit's flat buffer lies in one rank's shard (every matrix under
    `shard_boundary="params"`, small ones otherwise) is transformed by the rank that holds it,
    with no communication; the others hold an empty piece of it;
  * the matrices that cross rank boundaries are gathered and transformed by one owner each,
    assigned round-robin over the shard group in the unit's order (so the transform's work divides
    by the group's size), and the results go back to the pieces: per unit with any such matrix,
    one all-gather of the updates (the unit's flat shard, N x S) and one reduce-scatter of the
    results (zeros where a rank owns nothing, so the sum is exact). On the wire that is one
    parameter gather plus one gradient reduction of the unit per step, in the update's dtype,
    counted in the unit's `comm_stats()`.
Every rank of the shard group must call it with the same pieces in the same order (as an
optimizer over the same model does). Replicas (HSDP) compute the same results independently.
Tensor-parallel matrices are refused (their whole would be gathered over tp as well).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from . import collectives as C


def map_whole(updates: List[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """For each `ShardPiece` in `updates`, this rank's piece of `fn(full matrix)` as a plain 1-D
    float32 tensor (see [Note: whole matrices from pieces]). Collective over each unit's shard group."""
    results: List[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    by_unit: Dict[int, list] = {}
    units = {}
    for i, u in enumerate(updates):
        unit, index = u.piece_spec.owner()
        if unit.entries[index].tp is not None:
            raise NotImplementedError(
                f"{unit.name}: a tensor-parallel matrix's whole spans the tp ranks too; whole-matrix optimizers "
                "(optimizer=muon) run with parallelism.tp=1"
            )
        by_unit.setdefault(id(unit), []).append((i, index))
        units[id(unit)] = unit
    for key, members in by_unit.items():
        unit = units[key]
        L = unit.layout
        S, N, me = L.shard_numel, L.world, L.rank
        crossing = []
        for i, index in members:
            e = unit.entries[index]
            local = updates[i].to_local()
            first, last = e.offset // S, (e.offset + e.numel - 1) // S
            if first != last:
                crossing.append((i, index))
            elif first == me:
                results[i] = fn(local.reshape(e.shape)).reshape(-1).float()
            else:
                results[i] = local.new_zeros(0, dtype=torch.float32)
        if not crossing:
            continue
        transport = unit.transports()[0]
        send = torch.zeros(S, dtype=torch.float32, device=unit.compute_device)
        for i, index in crossing:
            send[L.shard_slice(unit.entries[index])] = updates[i].to_local().float()
        full = torch.empty(N * S, dtype=torch.float32, device=unit.compute_device)
        C.wait(C.all_gather(full, send, transport, unit.stats, f"{unit.name}:whole"))
        out = torch.zeros(N * S, dtype=torch.float32, device=unit.compute_device)
        for k, (_, index) in enumerate(crossing):
            if k % N == me:  # round-robin owners
                e = unit.entries[index]
                span = slice(e.offset, e.offset + e.numel)
                out[span] = fn(full[span].view(e.shape)).reshape(-1).float()
        mine = torch.empty(S, dtype=torch.float32, device=unit.compute_device)
        extra = transport.scratch_numel(S)
        scratch = torch.empty(extra, dtype=torch.float32, device=unit.compute_device) if extra else None
        C.wait(C.reduce_scatter(mine, out, transport, unit.stats, f"{unit.name}:whole", scratch))
        for i, index in crossing:
            results[i] = mine[L.shard_slice(unit.entries[index])]
    return results
