"""Whole matrices for optimizers that need them (Muon, Shampoo): `map_whole`.

[Note: whole matrices from pieces]
An optimizer step that transforms each matrix as a whole (Muon's Newton-Schulz orthogonalization)
gets, from `ShardPiece.map_whole(updates, fn)`, this rank's piece of `fn(full matrix)` for each
update piece, computed where the matrix is whole. Each matrix gets one dp owner in its unit's
shard group:
  * a matrix whose range in its unit's flat buffer lies in one rank's shard (every matrix under
    `shard_boundary="params"`, small ones otherwise) is owned by the rank that holds it, with no
    communication over dp; the others hold an empty piece of it;
  * the matrices that cross rank boundaries are owned round-robin over the shard group, in the
    order of their offsets in the unit's flat buffer (so the transform's work divides by the
    group's size, and the assignment depends on the layout alone), and go there and back in one
    all-gather of the updates (the unit's flat shard, N x S) and one reduce-scatter of the results
    (zeros where a rank owns nothing, so the sum is exact): per step and per unit with any such
    matrix, (N-1) x S x 4 bytes received and (N-1) x S x 4 sent, in fp32.
Under tensor parallelism ([Note: tensor parallel composition] in unit.py) a unit holds each
tp-split matrix's tp-local slice (Shard(0) colwise, Shard(1) rowwise, even over tp), so the dp
owner has a slice of the matrix only; the ranks of its tp group (the same dp index, so the same
dp owners: the layout is the same on every tp rank) then make it whole over tp, per unit: one
all-gather over tp of the slices of the M elements of tp-local matrices that the group's dp index
owns (the owner's tp rank: every T-th of them, in the same order), the owner concatenates the T
slices on the split dim, transforms, cuts the result back into slices, and one reduce-scatter
over tp returns each rank its slice: (T-1) x M x 4 bytes received and (T-1) x M x 4 sent, in fp32,
on top of the dp traffic (M differs between dp indices; the tp groups of other dp indices run
theirs at the same time). The transforms divide by N x T. Every exchange is counted in the
unit's `comm_stats()` (and planned by framework/planner/estimate.py's `traffic`).
Every rank of the shard group (and of the tp group) must call it with the same pieces in the same
order (as an optimizer over the same model does). Replicas (HSDP) compute the same results
independently.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import collectives as C


def tp_split_dim(e) -> Optional[int]:
    """The dim tensor parallelism splits entry `e` on (its tp-local slice is 1/T of it there), or
    None when it is not split over tp (no tp, or replicated)."""
    if e.tp is None:
        return None
    dims = [pl.dim for pl in e.tp.placements if pl.is_shard()]
    if not dims:
        return None
    T = e.tp.mesh.size()
    d = dims[0] % len(e.tp.shape)
    if len(dims) > 1 or e.tp.shape[d] != T * e.shape[d]:
        raise NotImplementedError(
            f"a tensor-parallel matrix of shape {tuple(e.tp.shape)} placed {e.tp.placements} over {T} ranks: whole "
            "matrices are made from one even split on one dim"
        )
    return d


def map_whole(updates: List[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """For each `ShardPiece` in `updates`, this rank's piece of `fn(full matrix)` as a plain 1-D
    float32 tensor (see [Note: whole matrices from pieces]). Collective over each unit's shard
    group, and its tp group for tensor-parallel matrices."""
    results: List[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    by_unit: Dict[int, list] = {}
    units = {}
    for i, u in enumerate(updates):
        unit, index = u.piece_spec.owner()
        by_unit.setdefault(id(unit), []).append((i, index))
        units[id(unit)] = unit
    for key, members in by_unit.items():
        _unit_whole(units[key], members, updates, results, fn)
    return results


def _unit_whole(unit, members: list, updates: list, results: list, fn: Callable) -> None:
    L = unit.layout
    S, N, me = L.shard_numel, L.world, L.rank
    dev = unit.compute_device
    members = sorted(members, key=lambda m: unit.entries[m[1]].offset)  # the layout's order, on every rank
    crossing, tp_owned = [], []  # tp_owned: (i, index, crosses dp) of tp-split matrices this dp rank owns
    for i, index in members:
        e = unit.entries[index]
        first, last = e.offset // S, (e.offset + e.numel - 1) // S
        if first != last:
            crossing.append((i, index))
        elif first != me:
            results[i] = updates[i].to_local().new_zeros(0, dtype=torch.float32)
        elif tp_split_dim(e) is not None:
            tp_owned.append((i, index, False))
        else:
            local = updates[i].to_local()
            results[i] = fn(local.reshape(e.shape)).reshape(-1).float()
    full = out = None
    if crossing:
        transport = unit.transports()[0]
        send = torch.zeros(S, dtype=torch.float32, device=dev)
        for i, index in crossing:
            send[L.shard_slice(unit.entries[index])] = updates[i].to_local().float()
        full = torch.empty(N * S, dtype=torch.float32, device=dev)
        C.wait(C.all_gather(full, send, transport, unit.stats, f"{unit.name}:whole"))
        out = torch.zeros(N * S, dtype=torch.float32, device=dev)
        for k, (i, index) in enumerate(crossing):
            if k % N == me:  # round-robin owners
                e = unit.entries[index]
                span = slice(e.offset, e.offset + e.numel)
                if tp_split_dim(e) is not None:
                    tp_owned.append((i, index, True))
                else:
                    out[span] = fn(full[span].view(e.shape)).reshape(-1).float()
    if tp_owned:
        _whole_over_tp(unit, tp_owned, updates, results, full, out, fn)
    if crossing:
        mine = torch.empty(S, dtype=torch.float32, device=dev)
        extra = transport.scratch_numel(S)
        scratch = torch.empty(extra, dtype=torch.float32, device=dev) if extra else None
        C.wait(C.reduce_scatter(mine, out, transport, unit.stats, f"{unit.name}:whole", scratch))
        for i, index in crossing:
            results[i] = mine[L.shard_slice(unit.entries[index])]


def _whole_over_tp(unit, owned: list, updates: list, results: list, full, out, fn: Callable) -> None:
    """The tp-split matrices this dp rank owns, made whole over its tp group and transformed by one
    tp owner each: [Note: whole matrices from pieces]. A crossing one is read from the dp gather
    (`full`) and its result written to the dp reduce-scatter's input (`out`); one held here whole
    over dp is read from its piece and its result is this rank's piece."""
    dev = unit.compute_device
    entries = [unit.entries[index] for _, index, _ in owned]
    mesh = entries[0].tp.mesh
    if any(e.tp.mesh is not mesh for e in entries):  # one tp mesh per model (parallelize.py)
        raise NotImplementedError(f"{unit.name}: tensor-parallel matrices on different tp meshes")
    group = mesh.get_group()
    transport = C.transport_for(group, dev)
    T, t = transport.world, dist.get_rank(group)
    offsets, M = [], 0
    for e in entries:
        offsets.append(M)
        M += e.numel
    send = torch.empty(M, dtype=torch.float32, device=dev)
    for (i, _, crosses), e, o in zip(owned, entries, offsets):
        src = full[e.offset : e.offset + e.numel] if crosses else updates[i].to_local()
        send[o : o + e.numel] = src.float()
    gathered = torch.empty(T * M, dtype=torch.float32, device=dev)
    C.wait(C.all_gather(gathered, send, transport, unit.stats, f"{unit.name}:whole-tp"))
    back = torch.zeros(T * M, dtype=torch.float32, device=dev)
    for k, (e, o) in enumerate(zip(entries, offsets)):
        if k % T == t:  # round-robin tp owners
            d = tp_split_dim(e)
            whole = torch.cat([gathered[r * M + o : r * M + o + e.numel].view(e.shape) for r in range(T)], dim=d)
            for r, part in enumerate(fn(whole).float().chunk(T, dim=d)):
                back[r * M + o : r * M + o + e.numel] = part.reshape(-1)
    mine = torch.empty(M, dtype=torch.float32, device=dev)
    extra = transport.scratch_numel(M)
    scratch = torch.empty(extra, dtype=torch.float32, device=dev) if extra else None
    C.wait(C.reduce_scatter(mine, back, transport, unit.stats, f"{unit.name}:whole-tp", scratch))
    for (i, _, crosses), e, o in zip(owned, entries, offsets):
        if crosses:
            out[e.offset : e.offset + e.numel] = mine[o : o + e.numel]
        else:
            results[i] = mine[o : o + e.numel]
