"""The canonical summation tree's arithmetic ([Note: one summation tree, whatever the layout] in
canonical.py): a fixed binary tree over leaves numbered by the data, as one call (`tree_sum`), as
leaves pushed in order (`TreeSum`) and over a vector's entries (`tree_sum_slots`). Depends on
nothing of the engine, so the transports below the engine's views can add in the tree's order."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def tree_sum(leaves: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The canonical tree's sum of `leaves` (leaf i is number i), as a new tensor (or the only
    leaf), or written into `out` (the root's addition writes it: the same bits)."""

    def node(lo: int, size: int, dst: Optional[torch.Tensor]) -> torch.Tensor:
        if size == 1:
            return leaves[lo] if dst is None else dst.copy_(leaves[lo])
        half = size // 2
        if lo + half >= len(leaves):
            return node(lo, half, dst)
        return torch.add(node(lo, half, None), node(lo + half, half, None), out=dst)

    if not leaves:
        raise ValueError("tree_sum of no leaves")
    return node(0, _pow2_at_least(len(leaves)), out)


class TreeSum:
    """The canonical tree over leaves pushed in order (leaf 0 first): at most log2(k) + 1 partial
    sums live at once (a binary counter); `total()` folds them as the tree does."""

    def __init__(self) -> None:
        self._stack: List[Tuple[int, torch.Tensor]] = []  # (level, the sum of a complete subtree)

    def __len__(self) -> int:
        return len(self._stack)

    def push(self, leaf: torch.Tensor) -> Optional[torch.Tensor]:
        """Add the next leaf (owned by the tree from now on); returns a buffer freed by the merge."""
        level, freed = 0, None
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            left.add_(leaf)  # left + right: the tree's order (and IEEE addition commutes)
            freed, leaf, level = leaf, left, level + 1
        self._stack.append((level, leaf))
        return freed

    def total(self) -> torch.Tensor:
        """The sum of every leaf pushed, and a fresh start. The leftover subtrees of an n that is
        not a power of two (sizes falling left to right) join right to left: node [0, 16) of 13
        leaves is [0, 8) + ([8, 12) + [12, 13))."""
        acc = None
        while self._stack:
            _, t = self._stack.pop()
            acc = t if acc is None else t.add_(acc)
        if acc is None:
            raise ValueError("TreeSum.total with no leaf")
        return acc


def tree_sum_slots(slots: torch.Tensor) -> float:
    """The canonical tree's sum of a 1-D vector's entries (float64 on the host)."""
    return float(tree_sum(list(slots.double().cpu().unbind())))
