"""The deterministic mode's summation tree ([Note: one summation tree, whatever the layout] in
framework/distributed/fsdp/canonical.py), without a process group: the ranks' subtrees joined in
tree order give the one-rank sum's bits for every power-of-two split, and the gradient norm's
block sums give the same total wherever a parameter is cut. Exact comparisons throughout: the
point is that the bits do not move."""

from __future__ import annotations

import torch

from framework.distributed.fsdp.canonical import _block_sums, _param_total
from framework.distributed.fsdp.tree import TreeSum, _pow2_at_least, tree_sum


def _leaves(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    # values of mixed magnitudes, so that the order of additions shows in the bits
    return [torch.randn(257, generator=g) * 10.0 ** torch.randint(-4, 4, (257,), generator=g) for _ in range(n)]


def test_pushing_leaves_in_order_is_the_tree():
    for n in range(1, 14):
        leaves = _leaves(n, n)
        tree = TreeSum()
        for leaf in leaves:
            tree.push(leaf.clone())
            assert len(tree) <= n.bit_length()  # log2 partial buffers at most
        assert torch.equal(tree.total(), tree_sum(leaves)), n


def test_rank_subtrees_joined_in_tree_order_are_one_ranks_sum():
    leaves = _leaves(16)
    one = tree_sum(leaves)
    for ranks in (2, 4, 8, 16):
        k = 16 // ranks
        subtrees = []
        for r in range(ranks):  # rank r holds units [r k, (r + 1) k) and adds them as they come
            tree = TreeSum()
            for leaf in leaves[r * k : (r + 1) * k]:
                tree.push(leaf.clone())
            subtrees.append(tree.total())
        assert torch.equal(tree_sum(subtrees), one), ranks
        # hybrid: shard groups of 2 (a subtree each), then the replicas
        if ranks >= 4:
            pairs = [tree_sum(subtrees[i : i + 2]) for i in range(0, ranks, 2)]
            assert torch.equal(tree_sum(pairs), one)
    # and a left-to-right running sum (what accumulation does) is not the tree: the test can fail
    running = leaves[0].clone()
    for leaf in leaves[1:]:
        running += leaf
    assert not torch.equal(running, one)


def _canonical(x: torch.Tensor, n: int, cuts: list, batch: int = 1 << 20) -> float:
    """The parameter's tree total of `x`'s squares from the block sums of the pieces `cuts` make."""
    blocks = {}
    bounds = [0, *cuts, n]
    for lo, hi in zip(bounds, bounds[1:]):
        for start, size, value in _block_sums(x[lo:hi], lo, hi, n, batch) if hi > lo else []:
            blocks[(start, size)] = float(value)
    return _param_total(blocks, _pow2_at_least(n))


def _per_piece(x: torch.Tensor, n: int, cuts: list) -> float:
    """What a plain sharded norm does: each piece's sum, then the pieces' sum."""
    bounds = [0, *cuts, n]
    return sum(float(x[lo:hi].double().square().sum()) for lo, hi in zip(bounds, bounds[1:]))


def test_norm_blocks_give_the_same_total_wherever_a_parameter_is_cut():
    g = torch.Generator().manual_seed(3)
    moved = 0
    for n in (1, 7, 64, 1000, 1025):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 3, (n,), generator=g)
        whole = _canonical(x, n, [])
        for cuts in ([n // 2], [n // 3, n // 2], [1, n - 1], [n // 4, n // 2, 3 * n // 4], [3, 333, 777]):
            cuts = sorted({c for c in cuts if 0 < c < n})
            assert _canonical(x, n, cuts) == whole, (n, cuts)
            moved += _per_piece(x, n, cuts) != _per_piece(x, n, [])
    assert moved > 0  # the per-piece sums do move with the cuts: the equality above is the tree's


def _padded_tree(x: torch.Tensor) -> float:
    """The definition, spelled out: the float64 squares padded with zeros to a power of two, added
    pair by pair, level by level."""
    sq = x.double().square()
    v = torch.cat([sq, sq.new_zeros(_pow2_at_least(sq.numel()) - sq.numel())])
    while v.numel() > 1:
        v = v[0::2] + v[1::2]
    return float(v[0])


def test_norm_blocks_in_batches_are_the_padded_tree():
    """The block sums square as they go, fuse the first level (a + b*b), carry odd elements up
    instead of adding padding zeros, and cut long blocks into batches: the bits of the padded tree,
    for every cut and batch size (small batches here, so that blocks cross several)."""
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 3, 255, 256, 257, 1000, 4097):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 6, (n,), generator=g)
        whole = _padded_tree(x)
        for batch in (1, 2, 16, 64, 1 << 20):
            for cuts in ([], [n // 2], [1, n - 1], [n // 3, 2 * n // 3]):
                cuts = sorted({c for c in cuts if 0 < c < n})
                assert _canonical(x, n, cuts, batch) == whole, (n, batch, cuts)
