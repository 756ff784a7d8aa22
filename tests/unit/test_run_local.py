"""`framework.runtime.run_local`: the ranks `main.py` would start (spawn_local, init_distributed),
returning each rank's result; the benchmarks start their ranks with it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from framework.runtime import RanksFailed, run_local


def _sum_of_ranks(rank: int, world: int, scale: int) -> tuple:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, scale * t.item(), dist.get_backend()


def _rank_one_raises(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("the planted failure of rank 1")
    return rank


def _rank_one_sleeps(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)
    return rank


def test_each_rank_returns_its_result_after_a_collective():
    assert run_local(_sum_of_ranks, 2, args=(10,)) == [(0, 2, 30.0, "gloo"), (1, 2, 30.0, "gloo")]


def test_a_failed_rank_raises_with_its_rank_and_traceback():
    with pytest.raises(RanksFailed) as failed:
        run_local(_rank_one_raises, 2)
    message = str(failed.value)
    assert message.startswith("error: rank 1 (of 2) failed:\nTraceback (most recent call last):"), message
    assert message.rstrip().endswith("ValueError: the planted failure of rank 1"), message


def test_a_rank_past_the_time_limit_is_killed_and_named():
    started = time.monotonic()
    with pytest.raises(RanksFailed, match=r"^error: rank\(s\) 1 did not finish within 3 s$"):
        run_local(_rank_one_sleeps, 2, timeout_s=3)
    assert time.monotonic() - started < 20
