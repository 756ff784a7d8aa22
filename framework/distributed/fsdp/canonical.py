"""Sums whose bits depend on the data only: the deterministic mode's reductions.

[Note: one summation tree, whatever the layout]
Floating-point addition is not associative, so a sum's bits depend on its order; a reduce-scatter
adds in an order set by its algorithm and the world size, and gradient accumulation in the order a
rank meets its micro-batches. Under `trainer.deterministic=true` every sum that decides a weight
is instead one fixed binary tree over leaves numbered by the data:

* The leaves of the gradient sum are the step's *units* (fixed-size slices of the global batch,
  numbered in the global data order); each unit's gradient is one backward of its own. Leaf i of n
  sits under the canonical dyadic tree: node (lo, 2^L) = node(lo, 2^(L-1)) + node(lo + 2^(L-1),
  2^(L-1)), a node whose right half holds no leaf is its left half unchanged (x + 0 would give the
  same bits, except for -0).
* A data-parallel rank holds the k consecutive units [r*k, (r+1)*k) (the loader hands them out
  rank-major in this mode); with k a power of two they are one subtree, which the rank adds as the
  units come (`TreeSum`: log2 k partial buffers, a binary counter). Over the ranks, the owner of
  each shard receives the N subtrees' pieces by an all-to-all (a reduce-scatter's bytes exactly)
  and adds them in tree order (`tree_sum`); hybrid sharding then all-gathers the R replicas'
  shards (dp_shard a power of two, so the shard groups are subtrees) and adds them the same way.
  One rank with any k computes the same tree alone.
* The gradient norm is a tree too: per parameter over its flattened elements (each rank adds the
  largest aligned blocks inside its piece, the blocks cut by rank boundaries are finished from the
  gathered block sums), then over the parameters in model order (`canonical_grad_norm_`), in
  float64 from exactly squared fp32 values.
* Scalars summed over ranks (the step's loss) go slot per unit: every rank writes its own units'
  values into a vector of zeros, an all-reduce adds exactly one non-zero per slot (exact whatever
  its order), and every rank adds the slots in tree order (`tree_sum_slots`).
Elementwise work (the optimizers' steps, the clip's scaling) is the same per element wherever the
element lives (measured: AdamW on a tensor cut in three pieces equals AdamW on it whole).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist

from .tree import _pow2_at_least, tree_sum
from .views import ShardPiece

# Elements squared and summed at once by `_block_sums`: a block longer than this is summed in
# aligned batches of it (the same tree: a batch is a subtree), so the float64 work stays a few MiB
# instead of twice the gradient's size.
_BATCH = 1 << 20


def _pairwise(v: torch.Tensor) -> torch.Tensor:
    """The tree's sum of a float64 vector whose missing right-hand leaves are zeros: level by level,
    an odd last element carried up unchanged (the bits of it + 0, the values being >= 0)."""
    while v.numel() > 1:
        n = v.numel()
        pairs = v[0 : n - 1 : 2] + v[1:n:2]
        v = torch.cat([pairs, v[n - 1 :]]) if n % 2 else pairs
    return v


def _square_sum(x: torch.Tensor, size: int, batch: int) -> torch.Tensor:
    """The tree's sum over `size` (a power of two) leaves of the float64 squares of `x`'s elements,
    the leaves past `x` zeros. The first level is fused: a + b*b with b*b exact (24-bit mantissas
    in 53 bits), so with or without a fused multiply-add it is the sum of the two exact squares,
    rounded once."""
    if x.numel() > batch:  # aligned batches, each a subtree; then their sums as the tree's top
        return _pairwise(torch.cat([_square_sum(x[i : i + batch], batch, batch) for i in range(0, x.numel(), batch)]))
    n = x.numel()
    if n == 1:
        return x.double().square()
    first = x[0 : n - 1 : 2].double()
    first.mul_(first)
    odd = x[1:n:2].double()
    first.addcmul_(odd, odd)
    if n % 2:
        first = torch.cat([first, x[n - 1 :].double().square()])
    return _pairwise(first)


def _block_sums(x: torch.Tensor, lo: int, hi: int, end: int, batch: int = _BATCH) -> List[Tuple[int, int, float]]:
    """(start, size, sum) of the largest aligned power-of-two blocks covering element positions
    [lo, hi) of a parameter of `end` elements, each the float64 sum of its elements' exact squares
    (`x` holds the elements of [lo, hi)) in the tree's pairwise order. The piece that ends the
    parameter also covers the positions up to the tree's width, as zeros (never materialised): the
    same bits as a node without its right half."""
    top = _pow2_at_least(end) if hi == end else hi
    out, pos = [], lo
    while pos < top:
        size = 1
        while pos % (2 * size) == 0 and pos + 2 * size <= top:
            size *= 2
        stop = min(pos + size, hi)
        value = float(_square_sum(x[pos - lo : stop - lo], size, batch)) if stop > pos else 0.0
        out.append((pos, size, value))
        pos += size
    return out


def _param_total(blocks: Dict[Tuple[int, int], float], size: int) -> float:
    def node(lo: int, s: int) -> float:
        got = blocks.get((lo, s))
        if got is not None:
            return got
        if s == 1:
            raise AssertionError(f"canonical_grad_norm_: no rank sent position {lo} of a gradient")
        half = s // 2
        return node(lo, half) + node(lo + half, half)

    return node(0, size)


def canonical_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The 2-norm of every gradient, summed in the fixed tree of [Note: one summation tree, whatever
    the layout], so its bits do not depend on how the parameters are sharded; clips in place by
    `max_norm` (inf: measure only). Collective over the default group (one all-gather of each
    rank's block sums, a few per parameter piece). Returns the norm (float32, every rank)."""
    params = list(params)
    mine: List[Tuple[int, int, int, float]] = []  # (parameter number, block start, block size, sum)
    sizes: Dict[int, int] = {}
    device = torch.device("cpu")
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if isinstance(g, ShardPiece):
            owner = g.piece_spec.owner()
            unit, index = owner
            e = unit.entries[index]
            sl = unit.layout.piece_slice(e)
            lo, hi, n = sl.start, sl.stop, e.numel
            local = g.to_local()
        else:
            local, lo, n = g.detach().reshape(-1), 0, g.numel()
            hi = n
        device = local.device
        sizes[i] = n
        if hi <= lo:
            continue
        # squared exactly in float64 (24-bit mantissas, 53 bits of room) as the blocks are summed
        for start, size, value in _block_sums(local.detach().reshape(-1), lo, hi, n):
            mine.append((i, start, size, value))
    gathered = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)  # replicas send the same blocks: kept once
    blocks: Dict[int, Dict[Tuple[int, int], float]] = {}
    for rank_blocks in gathered:
        for i, start, size, value in rank_blocks:
            blocks.setdefault(i, {})[(start, size)] = value
    per_param = [_param_total(blocks.get(i, {}), _pow2_at_least(sizes[i])) for i in sorted(sizes) if sizes[i]]
    total = tree_sum([torch.tensor(v, dtype=torch.float64) for v in per_param]) if per_param else torch.zeros(())
    norm = total.double().sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if float(coef) != 1.0:  # a factor of 1 leaves every bit as it is: no pass over the gradients
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return norm.float().to(device)
