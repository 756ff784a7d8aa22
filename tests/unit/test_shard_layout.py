"""framework/distributed/shard_layout.py's answers for the planner, against asking every rank."""

import random

import pytest

from framework.distributed.shard_layout import busiest_rank, elements_on, granule, pack


@pytest.mark.parametrize("boundary", ["anywhere", "rows", "params"])
def test_busiest_rank_is_the_first_rank_holding_the_most_elements(boundary):
    rng = random.Random(0)
    for _ in range(400):
        N = rng.randint(1, 12)
        rows = [rng.randint(1, 8) for _ in range(rng.randint(0, 14))]
        shapes = [(rng.randint(0, 8) * row, row) for row in rows]  # (elements, elements per row)
        sizes = [(n, granule(n, row, boundary)) for n, row in shapes]
        offsets, S = pack(sizes, N, rng.choice([1, 4]))
        counts = [elements_on(r, offsets, sizes, S) for r in range(N)]
        assert busiest_rank(offsets, sizes, S, N) == counts.index(max(counts)), (shapes, N, boundary)
