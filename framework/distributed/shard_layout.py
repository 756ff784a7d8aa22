"""Where shard boundaries fall in a unit's flat buffer: the layout policy, without torch.

[Note: shard boundaries]
A unit's parameters lie one after the other in a flat buffer of N x S elements and rank r owns
[r S, (r+1) S) ([Note: flat storage] in fsdp/flat.py). Where a rank's range may begin or end
inside a parameter is the policy:
  * "anywhere": the parameters are packed tightly and S = ceil(T / N): the least padding (under N
    elements), and a rank's piece of a matrix may start or end inside a row;
  * "rows": no rank boundary cuts a row (a matrix's rows are its dim-0 slices; a 1-D parameter's
    rows are its elements): each rank's piece of a matrix is a set of whole rows, what row-wise
    block formats and row-wise optimizers need;
  * "params": no rank boundary cuts a parameter: every parameter lives whole on one rank, so an
    optimizer that needs whole matrices (Muon, Shampoo) has each one whole on some rank (Muon's
    balanced owners may still take it elsewhere: [Note: balancing whole-matrix owners]).
The packing keeps the parameters' order and each parameter contiguous (so every full parameter is
still a view of the gathered buffer: the gather path's copy budget is unchanged). Walking them, a
parameter that a boundary would cut inside a granule (its row, or the whole parameter) starts a
little later, at the next position where every boundary inside it falls between granules: a gap
of less than one granule, or, for a parameter that fits in one range, the next range. A parameter
longer than S crosses several boundaries, which then fall between its rows only if S is a multiple
of its row: S is rounded up to the least common multiple of those rows (and of `align`), then
grown by that step until everything fits. The padding is reported: under one granule per
parameter plus, per rank, the rounding of S; for the whole-parameter policy S is at least the
largest parameter.
The planner (framework/planner/estimate.py) packs its tensor shapes with the same function, so its
memory and traffic figures are the engine's own.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

BOUNDARIES = ("anywhere", "rows", "params")


def granule(numel: int, row: int, boundary: str) -> int:
    """The unit a rank boundary may not cut, in elements, for a parameter of `numel` elements whose
    rows hold `row` elements each (1 for a 1-D or 0-D parameter)."""
    if boundary == "anywhere" or numel == 0:
        return 1
    if boundary == "rows":
        return max(1, row)
    if boundary == "params":
        return numel
    raise ValueError(f"shard_boundary={boundary!r}: choose one of {', '.join(BOUNDARIES)}")


def pack(sizes: Sequence[Tuple[int, int]], world: int, align: int = 1) -> Tuple[List[int], int]:
    """(offsets, S): where each parameter, given as (numel, granule), starts in the flat buffer,
    and the elements each of the `world` ranks owns. See [Note: shard boundaries]."""
    total = sum(n for n, _ in sizes)

    def legal(S: int) -> int:  # S rounded up to a multiple of `align` and of the rows crossing ranks
        for _ in range(64):
            step = math.lcm(align, *[g for n, g in sizes if n > S])
            rounded = -(-S // step) * step
            if rounded == S:
                return S
            S = rounded
        return S

    S = legal(max(1, -(-total // world), max((g for n, g in sizes if n), default=1)))
    offsets = _fit(sizes, S, world)
    if offsets is not None:
        return offsets, S
    bad, good = S, legal(S + max(1, S // 16))
    while (offsets := _fit(sizes, good, world)) is None:  # grow by ~6% until it fits
        bad, good = good, legal(good + max(1, good // 16))
    while True:  # then the smallest legal size between the last that did not fit and the first that did
        mid = legal((bad + good) // 2 + 1)
        if mid >= good:
            return offsets, good
        found = _fit(sizes, mid, world)
        if found is None:
            bad = mid
        else:
            good, offsets = mid, found


def _fit(sizes: Sequence[Tuple[int, int]], S: int, world: int) -> Optional[List[int]]:
    """Offsets at which each parameter starts, no rank boundary inside a granule, or None."""
    offsets, pos, end = [], 0, world * S
    for numel, g in sizes:
        while numel and g > 1:
            first = (pos // S + 1) * S  # the first boundary after pos
            if first >= pos + numel:
                break  # inside one range
            shift = (first - pos) % g
            if shift:
                pos += shift  # start later, so that the boundary falls between two granules
            elif numel > S and S % g:
                return None  # later boundaries would cut a granule (S is a multiple of g by `pack`)
            else:
                break
        offsets.append(pos)
        pos += numel
        if pos > end:
            return None
    return offsets


def elements_on(rank: int, offsets: Sequence[int], sizes: Sequence[Tuple[int, int]], S: int) -> int:
    """Parameter elements in rank `rank`'s range [rank S, (rank+1) S)."""
    lo, hi = rank * S, (rank + 1) * S
    return sum(max(0, min(o + n, hi) - max(o, lo)) for o, (n, _) in zip(offsets, sizes))


def busiest_rank(offsets: Sequence[int], sizes: Sequence[Tuple[int, int]], S: int, N: int) -> int:
    """The first of the ranks < N holding the most parameter elements (`elements_on`), without
    asking every rank (the planner's question for Mixtral at 64 ranks was N x entries calls: a
    minute). A rank's count can differ from 0 and S only where an entry starts or ends inside it,
    and the first rank wholly inside an entry has S, the most there is: so only those ranks are
    counted, in one sweep (entries do not overlap: [Note: shard boundaries])."""
    spans = sorted((o, o + n) for o, (n, _) in zip(offsets, sizes) if n > 0)
    candidates = set()
    for lo, hi in spans:
        candidates.update((lo // S, (hi - 1) // S))
        inside = -(-lo // S)  # the first rank starting at or after the entry's start
        if (inside + 1) * S <= hi:
            candidates.add(inside)
    best, best_count = 0, -1
    i, below = 0, 0  # spans[:i] end at or below the last edge asked; `below`: their elements

    def under(x: int) -> int:  # entry elements below x; x never decreases between calls
        nonlocal i, below
        while i < len(spans) and spans[i][1] <= x:
            below += spans[i][1] - spans[i][0]
            i += 1
        return below + (max(0, x - spans[i][0]) if i < len(spans) else 0)

    for r in sorted(c for c in candidates if c < N):
        start = under(r * S)
        count = under((r + 1) * S) - start
        if count > best_count:
            best, best_count = r, count
    return best
