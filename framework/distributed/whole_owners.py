"""Which rank orthogonalizes which matrix, and what moves for it: without torch.

[Note: balancing whole-matrix owners]
An optimizer that transforms whole matrices (Muon's Newton-Schulz iteration) gives each matrix one
owner among the ranks of its shard group, which receives the pieces the other ranks hold, runs the
transform and sends each piece of the result back ([Note: whole matrices from pieces] in
fsdp/whole.py). The owners are chosen over every matrix of the call at once (the optimizer's Muon
group: the whole model; expert parallelism's efsdp group apart from the dense one), not unit by
unit, so that the work divides over the group:
  * each matrix costs `newton_schulz_flops` of its whole shape (global over tensor parallel);
  * largest first, each onto the rank with the least work so far, the lowest rank among equals
    (LPT scheduling: within 4/3 of the best possible, and at most the mean plus the largest
    matrix);
  * matrices of equal cost are placed together: the ranks they go to are decided first (one each
    onto the least-loaded rank, as above), then matched to the matrices, each matrix to the rank
    among those holding the most of it, where one is among them (the ones held by fewest ranks
    first), the rest in order. The work per rank is exactly LPT's; the bytes are the fewest this
    matching finds.
So a matrix inside one rank's shard may move to another rank: balance comes first, because a
transform's work overlaps nothing (the step waits for the busiest rank), while moving a matrix
there and back costs 8 m n bytes against its 5 (4 m^2 n + 2 m^3) FLOPs, at least 2.5 m FLOPs a
byte: more than a GPU's FLOP/s over its in-node link's bytes/s for matrices of m >= ~1000 (the
arithmetic, and where it does not pay: docs/engine.md, "Whole-matrix optimizers"). Owners fixed by
the layout (a matrix inside a rank's shard that rank's, each unit's crossing ones round-robin)
gave the debug Llama's 4 ranks 8, 2, 2, 2 of its 14 calls and Llama 3.1 8B on 8 ranks 2.11x the
mean on the busiest rank and nothing on four; with this rule 3, 3, 4, 4 and 1.00x
(`python -m framework.distributed.whole_owners`, output: bench/results/whole_owners.txt).
Every input is the same on every rank (shapes, the layout's offsets), and ties break by rank and
by the layout's order (the units' module order, then offsets), so every rank computes the same
owners with no communication.

Moving only what each owner needs: rank r sends the owner of each matrix its piece of it, and the
owner sends each piece of the result back; per rank and call, the bytes it sends are its pieces of
the matrices others own plus, of the matrices it owns, the pieces others hold (x4: fp32). The
planner (framework/planner/estimate.py) runs the same functions on its own layout, so its bytes and
work equal the engine's.
"""

from __future__ import annotations

import heapq
from itertools import groupby
from typing import Dict, List, Sequence

NS_STEPS = 5  # the work's unit: the balance does not depend on the steps (every cost scales alike)


def newton_schulz_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """FLOPs of `steps` quintic Newton-Schulz steps on a matrix of `shape` (2-D; 3-D: that many
    stacked matrices, each on its own): per step on the wide orientation m x n (m <= n), X X^T
    (2 m^2 n), A @ A (2 m^3) and (b A + c A^2) X (2 m^2 n), as framework/optim/muon.py's
    `orthogonalize` does."""
    if len(shape) == 3:
        return shape[0] * newton_schulz_flops(shape[1:], steps)
    if len(shape) != 2:
        raise ValueError(f"a matrix's shape is 2-D or stacked 3-D, not {tuple(shape)}")
    m, n = sorted(int(d) for d in shape)
    return steps * (4 * m * m * n + 2 * m**3)


def holdings(offset: int, numel: int, shard: int, world: int) -> Dict[int, int]:
    """{rank: elements} of the ranks whose range [r S, (r+1) S) holds part of [offset, offset + numel)."""
    if numel <= 0:
        return {}
    first, last = offset // shard, min(world - 1, (offset + numel - 1) // shard)
    if first == last:
        return {first: numel}
    out = dict.fromkeys(range(first, last + 1), shard)  # the ranks inside hold S each
    out[first] = (first + 1) * shard - offset
    out[last] = min(offset + numel, (last + 1) * shard) - last * shard
    return out


def assign_owners(costs: Sequence[int], held: Sequence[Dict[int, int]], world: int) -> List[int]:
    """The owner rank of each matrix: [Note: balancing whole-matrix owners]. `costs[i]`: its work;
    `held[i]`: {rank: elements} of the ranks holding it."""
    owners = [0] * len(costs)
    least = [(0, r) for r in range(world)]  # (work so far, rank): a heap, the least loaded first
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    for cost, same in groupby(order, key=lambda i: costs[i]):
        same = list(same)
        free: Dict[int, int] = {}
        for _ in same:  # where equal matrices go: one by one onto the least loaded
            load, r = heapq.heappop(least)
            heapq.heappush(least, (load + cost, r))
            free[r] = free.get(r, 0) + 1
        rest = []
        for i in sorted(same, key=lambda i: (len(held[i]), i)):
            h = held[i]
            near = [(-h[r], r) for r in free if free[r] and r in h]  # a rank holding most of it
            if near:
                r = min(near)[1]
                owners[i] = r
                free[r] -= 1
            else:
                rest.append(i)
        slots = [r for r in sorted(free) for _ in range(free[r])]
        for i, r in zip(sorted(rest), slots):
            owners[i] = r
    return owners


def work_per_rank(costs: Sequence[int], owners: Sequence[int], world: int) -> List[int]:
    out = [0] * world
    for c, o in zip(costs, owners):
        out[o] += c
    return out


def max_over_ideal(work: Sequence[float]) -> float:
    """The busiest rank's work over the mean (1.0: divided evenly; 1.0 when there is none)."""
    total = sum(work)
    return max(work) * len(work) / total if total else 1.0


def bytes_sent(held: Sequence[Dict[int, int]], owners: Sequence[int], world: int, elem: int = 4) -> List[int]:
    """What each rank sends per call: its pieces of the matrices others own, and of the matrices it
    owns the pieces others hold (results going back). `held`: as `holdings` gives them (consecutive
    ranks in order, S elements each inside)."""
    out, inner = [0] * world, [0] * (world + 1)  # inner: a difference array of the S-element ranks
    for h, o in zip(held, owners):
        n = len(h)
        first = next(iter(h), o)
        if n <= 1:
            if first != o:  # held whole by another rank: there and back
                out[first] += h[first]
                out[o] += h[first]
            continue
        last = first + n - 1
        S = h[first + 1] if n > 2 else 0
        inner[first + 1] += S
        inner[last] -= S
        out[first] += h[first]
        out[last] += h[last]
        out[o] += h[first] + h[last] + (n - 2) * S - 2 * h.get(o, 0)  # results back, less its own
    run = 0
    for r in range(world):
        run += inner[r]
        out[r] += run
    return [n * elem for n in out]


def moves(held: Sequence[Dict[int, int]], owners: Sequence[int]) -> bool:
    """Whether any element leaves its rank (else no exchange is needed)."""
    return any(len(h) > 1 or (h and o not in h) for h, o in zip(held, owners))
