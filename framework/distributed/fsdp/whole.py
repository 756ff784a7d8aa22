"""Whole matrices for optimizers that need them (Muon, Shampoo): `map_whole`.

[Note: whole matrices from pieces]
An optimizer step that transforms each matrix as a whole (Muon's Newton-Schulz orthogonalization)
gets, from `ShardPiece.map_whole(updates, fn)`, this rank's piece of `fn(full matrix)` for each
update piece, computed where the matrix is whole. The matrices of one call are taken together,
group by group (the shard group of their units: the dense blocks' one, expert parallelism's efsdp
one), and each gets one owner in its group, chosen to divide the work over the group
([Note: balancing whole-matrix owners] in framework/distributed/whole_owners.py: largest first onto
the least-loaded rank, over the whole call, not unit by unit). Then, per group and call:
  * one all-to-all takes to each owner the pieces the other ranks hold of its matrices (only those:
    a matrix held whole by its owner moves nowhere), the owner transforms each, and one all-to-all
    takes each piece of the result back to the rank holding it; a rank holding no piece of a matrix
    gets an empty result. Per rank, the bytes sent are its pieces of the matrices others own plus,
    of its own, the pieces others hold, in fp32 (`whole_owners.bytes_sent`), counted as
    `alltoall_bytes`; neither all-to-all runs when nothing moves (e.g. shard_boundary="params"
    where each matrix's rank is also its owner).
Under tensor parallelism ([Note: tensor parallel composition] in unit.py) a unit holds each
tp-split matrix's tp-local slice (Shard(0) colwise, Shard(1) rowwise, even over tp), so the dp
owner has a slice of the matrix only; the ranks of its tp group (the same dp index, so the same
dp owners: the layout is the same on every tp rank) then make it whole over tp, once per call: one
all-gather over tp of the slices of the M elements of tp-split matrices the group's dp index owns,
the tp owner of each (balanced over the tp group by the same rule) concatenates the T slices on the
split dim, transforms, cuts the result back into slices, and one reduce-scatter over tp returns
each rank its slice: (T-1) x M x 4 bytes received and (T-1) x M x 4 sent, in fp32, on top of the
dp traffic (M differs between dp indices; the tp groups of other dp indices run theirs at the same
time). A matrix not split over tp is transformed by every rank of its owner's tp group alike.
Every exchange is counted in the first unit's `comm_stats()` (planned by
framework/planner/estimate.py's `traffic`), and so is the work: `whole_matrix_flops`, the FLOPs
of the transforms this rank ran (Newton-Schulz's count at 5 steps: `newton_schulz_flops`), and
`whole_matrix_max_over_ideal`, the busiest rank's planned work over the mean, over the dp x tp
ranks of the call.
Every rank of the shard group (and of the tp group) must call it with the same pieces in the same
order (as an optimizer over the same model does). Replicas (HSDP) compute the same results
independently.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..whole_owners import assign_owners, holdings, max_over_ideal, moves, newton_schulz_flops
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


def whole_shape(e) -> torch.Size:
    """The shape of the matrix `fn` is given for entry `e`: whole over tp where tp splits it."""
    return e.tp.shape if tp_split_dim(e) is not None else e.shape


def map_whole(updates: List[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> List[torch.Tensor]:
    """For each `ShardPiece` in `updates`, this rank's piece of `fn(full matrix)` as a plain 1-D
    float32 tensor (see [Note: whole matrices from pieces]). Collective over each unit's shard
    group, and its tp group for tensor-parallel matrices."""
    results: List[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    groups: Dict[int, list] = {}
    place: Dict[int, int] = {}  # a unit's place in its model's module order (the same on every rank)
    for i, u in enumerate(updates):
        unit, index = u.piece_spec.owner()
        e = unit.entries[index]
        if e.numel == 0:
            results[i] = u.to_local().new_zeros(0, dtype=torch.float32)
            continue
        if id(unit) not in place:
            units = unit.ctx.units if unit.ctx is not None else [unit]
            place[id(unit)] = next((k for k, v in enumerate(units) if v is unit), 0)
        # the order the owners are decided in: the layout's, then the call's (ties)
        groups.setdefault(id(unit.shard_group), []).append(((place[id(unit)], e.offset, i), i, unit, index))
    for members in groups.values():
        members.sort(key=lambda m: m[0])
        _group_whole([m[1:] for m in members], updates, results, fn)
    return results


def _group_whole(members: list, updates: list, results: list, fn: Callable) -> None:
    """The matrices of one shard group: owners, the exchange there and back, the transforms."""
    unit0 = members[0][1]
    N, me = unit0.layout.world, unit0.layout.rank
    dev, stats = unit0.compute_device, unit0.stats
    entries = [unit.entries[index] for _, unit, index in members]
    held = [holdings(e.offset, e.numel, unit.layout.shard_numel, N) for (_, unit, _), e in zip(members, entries)]
    costs = [newton_schulz_flops(whole_shape(e)) for e in entries]
    owners = assign_owners(costs, held, N)
    split = [tp_split_dim(e) is not None for e in entries]
    tp = _tp_plan(entries, costs, owners, split, N) if any(split) else None
    # the planned work of every rank (dp x tp), for the report
    T = tp[0] if tp is not None else 1
    work = [0] * (N * T)
    for k, (c, o) in enumerate(zip(costs, owners)):
        for t in range(T):
            if not split[k] or tp[1][k] == t:
                work[o * T + t] += c
    stats.whole_matrix_max_over_ideal = max(stats.whole_matrix_max_over_ideal, max_over_ideal(work))

    def piece(k: int, r: int) -> slice:  # where rank r's piece of matrix k lies in its flattening
        e, S = entries[k], members[k][1].layout.shard_numel
        return slice(max(e.offset, r * S) - e.offset, min(e.offset + e.numel, (r + 1) * S) - e.offset)

    def local(k: int) -> torch.Tensor:
        return updates[members[k][0]].to_local()

    mine = [k for k, o in enumerate(owners) if o == me]
    whole: Dict[int, torch.Tensor] = {}  # matrix k (owned here), flattened, whole over dp
    exchange = moves(held, owners)
    if exchange:  # the pieces to their owners: by destination, then in the members' order
        to_owner = [k for k, o in enumerate(owners) if o != me and me in held[k]]
        send_splits = [sum(held[k][me] for k in to_owner if owners[k] == r) for r in range(N)]
        recv_splits = [sum(held[k].get(r, 0) for k in mine) if r != me else 0 for r in range(N)]
        send = _cat([local(k) for r in range(N) for k in to_owner if owners[k] == r], dev)
        recv = torch.empty(sum(recv_splits), dtype=torch.float32, device=dev)
        C.wait(C.all_to_all_v(recv, send, recv_splits, send_splits, unit0.shard_group, stats, "whole"))
        at = 0
        for k in mine:
            if set(held[k]) != {me}:
                whole[k] = torch.empty(entries[k].numel, dtype=torch.float32, device=dev)
        for r in range(N):
            for k in mine:
                n = held[k].get(r, 0) if r != me else 0
                if n:
                    whole[k][piece(k, r)] = recv[at : at + n]
                    at += n
        for k in whole:
            if me in held[k]:
                whole[k][piece(k, me)] = local(k).to(dev, torch.float32)
    out: Dict[int, torch.Tensor] = {}  # matrix k (owned here): fn's result, flattened
    for k in mine:
        if k not in whole:  # held whole here: the piece is the matrix
            whole[k] = local(k)
        if not split[k]:
            out[k] = fn(whole[k].view(entries[k].shape)).reshape(-1).float()
            stats.whole_matrix_flops += costs[k]
    if tp is not None:
        ks = [k for k in mine if split[k]]
        out.update(_whole_over_tp(unit0, [entries[k] for k in ks], [whole[k] for k in ks], tp[1], ks, costs, fn))
    for k, o in enumerate(owners):
        if me not in held[k]:
            results[members[k][0]] = local(k).new_zeros(0, dtype=torch.float32)
        elif o == me:
            results[members[k][0]] = out[k][piece(k, me)]
    if exchange:  # the results back: by destination (the holders), then in the members' order
        back = [k for k, o in enumerate(owners) if o != me and me in held[k]]
        send = _cat([out[k][piece(k, r)] for r in range(N) if r != me for k in mine if r in held[k]], dev)
        recv = torch.empty(sum(send_splits), dtype=torch.float32, device=dev)
        C.wait(C.all_to_all_v(recv, send, send_splits, recv_splits, unit0.shard_group, stats, "whole"))
        at = 0
        for r in range(N):
            for k in back:
                if owners[k] == r:
                    n = held[k][me]
                    results[members[k][0]] = recv[at : at + n]
                    at += n


def _cat(pieces: List[torch.Tensor], dev: torch.device) -> torch.Tensor:
    if not pieces:
        return torch.empty(0, dtype=torch.float32, device=dev)
    return torch.cat([p.to(dev, torch.float32).reshape(-1) for p in pieces])


def _tp_plan(entries: list, costs: list, owners: list, split: list, N: int) -> Tuple[int, List[int]]:
    """(T, the tp owner of each tp-split matrix; -1 for the others): per dp index, the tp-split
    matrices it owns balanced over its tp group ([Note: balancing whole-matrix owners]); every
    rank computes every dp index's, for the report."""
    meshes = {id(e.tp.mesh) for e, s in zip(entries, split) if s}
    if len(meshes) > 1:  # one tp mesh per model (parallelize.py)
        raise NotImplementedError("tensor-parallel matrices on different tp meshes")
    mesh = next(e.tp.mesh for e, s in zip(entries, split) if s)
    T = mesh.size()
    tp_owner = [-1] * len(entries)
    by_owner: Dict[int, List[int]] = {}
    for k in range(len(entries)):
        if split[k]:
            by_owner.setdefault(owners[k], []).append(k)
    for ks in by_owner.values():
        chosen = assign_owners([costs[k] for k in ks], [{t: 1 for t in range(T)} for _ in ks], T)
        for k, t in zip(ks, chosen):
            tp_owner[k] = t
    return T, tp_owner


def _whole_over_tp(unit, entries: list, slices: list, tp_owner: list, ks: list, costs: list, fn: Callable) -> dict:
    """The tp-split matrices this dp rank owns (`slices`: each one's tp-local slice, whole over
    dp), made whole over its tp group and transformed by their tp owners: {matrix: this rank's
    slice of the result}. [Note: whole matrices from pieces]."""
    dev, stats = unit.compute_device, unit.stats
    if not entries:
        return {}
    group = entries[0].tp.mesh.get_group()
    transport = C.transport_for(group, dev)
    T, t = transport.world, dist.get_rank(group)
    offsets, M = [], 0
    for e in entries:
        offsets.append(M)
        M += e.numel
    send = _cat(slices, dev)
    gathered = torch.empty(T * M, dtype=torch.float32, device=dev)
    C.wait(C.all_gather(gathered, send, transport, stats, f"{unit.name}:whole-tp"))
    back = torch.zeros(T * M, dtype=torch.float32, device=dev)
    for k, e, o in zip(ks, entries, offsets):
        if tp_owner[k] == t:
            d = tp_split_dim(e)
            whole = torch.cat([gathered[r * M + o : r * M + o + e.numel].view(e.shape) for r in range(T)], dim=d)
            for r, part in enumerate(fn(whole).float().chunk(T, dim=d)):
                back[r * M + o : r * M + o + e.numel] = part.reshape(-1)
            stats.whole_matrix_flops += costs[k]
    mine = torch.empty(M, dtype=torch.float32, device=dev)
    extra = transport.scratch_numel(M)
    scratch = torch.empty(extra, dtype=torch.float32, device=dev) if extra else None
    C.wait(C.reduce_scatter(mine, back, transport, stats, f"{unit.name}:whole-tp", scratch))
    return {k: mine[o : o + e.numel] for k, e, o in zip(ks, entries, offsets)}
