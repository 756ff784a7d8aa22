"""`framework.local_ranks.run_local`: the ranks `main.py` would start (spawn_local, init_distributed),
returning each rank's result; the benchmarks start their ranks with it.

Each case runs `run_local` in a fresh interpreter, as `main.py` and the benchmarks do: on a CPU
build it forks its ranks, so the ranks start from a parent whose state is known (forked from a
pytest worker, they inherited the crash flag of an earlier in-process failure and ended with
status 1: the last test here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from conftest import REPO, main_env


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


def _run_local(fn: str, *args, before: str = "", **kwargs):
    """`run_local(<this module's fn>, 2, ...)` in a fresh interpreter, after the statement `before`
    there: (result, RanksFailed's message)."""
    code = (
        "import json, sys\n"
        "from framework.local_ranks import RanksFailed, run_local\n"
        f"from tests.unit.test_run_local import {fn}\n"
        f"{before}\n"
        "try:\n"
        f"    print(json.dumps([run_local({fn}, 2, args={args!r}, **{kwargs!r}), None]))\n"
        "except RanksFailed as exc:\n"
        "    print(json.dumps([None, str(exc)]))\n"
    )
    env = {**main_env(), "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_each_rank_returns_its_result_after_a_collective():
    result, failure = _run_local("_sum_of_ranks", 10)
    assert failure is None and result == [[0, 2, 30.0, "gloo"], [1, 2, 30.0, "gloo"]], (result, failure)


def test_a_failed_rank_raises_with_its_rank_and_traceback():
    result, message = _run_local("_rank_one_raises")
    assert result is None
    assert message.startswith("error: rank 1 (of 2) failed:\nTraceback (most recent call last):"), message
    assert message.rstrip().endswith("ValueError: the planted failure of rank 1"), message


def test_a_rank_past_the_time_limit_is_killed_and_named():
    started = time.monotonic()
    result, message = _run_local("_rank_one_sleeps", timeout_s=3)
    assert result is None and message == "error: rank(s) 1 did not finish within 3 s", message
    assert time.monotonic() - started < 30


def test_ranks_succeed_after_their_parent_reported_a_crash_in_process():
    # A process that ran a failing job in-process (the trainer's report_crash: a test, a benchmark)
    # then starts ranks: each forked rank used to inherit the crash flag and end with status 1 and
    # no report after its work succeeded (CI's tests/bench/test_memory_snapshots_bench.py did, in a
    # pytest worker after another file's failing job).
    before = (
        "from framework import runtime\n"
        "try:\n"
        "    raise RuntimeError('an earlier job of this process failed')\n"
        "except RuntimeError as exc:\n"
        "    runtime.report_crash(exc)"
    )
    result, failure = _run_local("_sum_of_ranks", 10, before=before)
    assert failure is None and result == [[0, 2, 30.0, "gloo"], [1, 2, 30.0, "gloo"]], (result, failure)


def _collect_then_sum(rank: int, world: int, scale: int) -> tuple:
    import gc

    gc.collect()  # what any allocation may trigger in a rank
    return _sum_of_ranks(rank, world, scale)


def test_ranks_do_not_collect_a_store_their_parent_left_as_garbage():
    # A process that ran a job in-process may hold a TCPStore in a reference cycle, not yet
    # collected (a test, a notebook). A forked rank that collected it ran its destructor, which
    # joins the store's thread: a thread a fork does not copy, so the rank hung for good (seen as a
    # pytest worker's benchmark test hanging after another file's in-process job).
    before = (
        "import gc, torch.distributed as dist\n"
        "from framework.runtime import free_port\n"
        "gc.disable()\n"
        "cycle = [dist.TCPStore('127.0.0.1', free_port(), 1, True, use_libuv=True)]\n"
        "cycle.append(cycle)\n"
        "del cycle  # garbage now; automatic collection stays off so the parent keeps it until the fork"
    )
    result, failure = _run_local("_collect_then_sum", 10, before=before, timeout_s=60)
    assert failure is None and result == [[0, 2, 30.0, "gloo"], [1, 2, 30.0, "gloo"]], (result, failure)


def test_a_crashed_job_in_process_leaves_no_process_group_for_the_next():
    # A process that runs jobs one after the other (a test session, a sweep): a job that crashed
    # kept its world-of-one group up, and the crash mark stayed set, so every later job in the
    # process left its group up too (a later module of the same pytest worker found torch's default
    # group already initialised).
    code = (
        "import torch.distributed as dist\n"
        "from framework import runtime\n"
        "rt = runtime.init_distributed('cpu')\n"
        "try:\n"
        "    raise RuntimeError('this job failed')\n"
        "except RuntimeError as exc:\n"
        "    runtime.report_crash(exc)\n"
        "runtime.shutdown()\n"
        "print('after crash', dist.is_initialized())\n"
        "runtime.forget_crash()\n"
        "runtime.init_distributed('cpu')\n"
        "runtime.shutdown()\n"
        "print('next job', dist.is_initialized())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=main_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["after crash False", "next job False"], done.stdout
