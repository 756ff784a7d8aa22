"""Start N gloo ranks on this machine, run one picklable function per rank, return the results.

Usage::

    from tests.distributed.harness import run_ranks
    results = run_ranks(my_fn, world_size=2, args=(cfg,), timeout_s=120)
    # results[r] is what my_fn(rank, world_size, *args) returned on rank r

The ranks start as every rank of the framework does, through `framework.local_ranks.run_local`
(the process group `init_distributed` makes, its failure report, its time limit); `run_ranks` only
gives it the tests' choices: the ranks are forked from the tests' fork server, which imported
torch and the engine once, never from the test process (which ran autograd and opened process
groups: [Note: the tests' fork server] in tests/fork_server.py), and `timeout_s` bounds the whole
run and every collective in it. `my_fn` must be defined at module level (it is pickled for the
fork server). The process group is initialised before `my_fn` runs and destroyed after. A failure
on any rank raises `RanksFailed` here with that rank's traceback (several cases in one spawn: see
`recorded`); a rank that does not finish within `timeout_s` is killed and named in `RanksFailed`,
so a deadlocked collective never hangs the test suite. Each rank runs with one compute thread (as
torchrun does) so gloo's communication threads get a core.

The backend is gloo unless `TEST_DIST_BACKEND` names NCCL when `run_ranks` is called (e.g.
`cpu:gloo,cuda:nccl` on a GPU machine: CPU tensors still use gloo, CUDA tensors NCCL, each rank on
the GPU of its local rank, as `main.py`'s ranks).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from framework.local_ranks import RanksFailed, run_local
from framework.profiling import peak_delta_bytes  # noqa: F401 - the tests' peak reader, the benchmarks' too
from tests.fork_server import PRELOAD, context


def run_ranks(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results."""
    device = "cuda" if "nccl" in os.environ.get("TEST_DIST_BACKEND", "gloo") else "cpu"
    context()  # the tests' fork server, started as tests/fork_server.py starts it
    return run_local(
        fn,
        world_size,
        args=args,
        device=device,
        timeout_s=timeout_s,
        collective_timeout_s=timeout_s,
        start="forkserver",
        preload=PRELOAD,
    )


# [Note: one spawn, many cases, each failing with its own traceback]
# A module runs many cases in one group of ranks (starting ranks is the slow part). In the rank,
# `recorded(case, ...)` turns an exception into {"error": "rank r of n: <traceback>"}, so one
# failing case does not hide the others; `records_of` keeps rank 0's records, or another rank's
# error record where that rank's case raised; and the test's `passed(record)` fails with that
# traceback as the whole failure message, as if the assertion had failed in the test itself.


def recorded(case: Callable, *args, **kwargs) -> Any:
    """`case(*args, **kwargs)` in a rank; an exception becomes {"error": the rank and traceback}."""
    try:
        return case(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the test of this case fails with it (`passed`)
        where = f"rank {dist.get_rank()} of {dist.get_world_size()}" if dist.is_initialized() else "rank 0 of 1"
        return {"error": f"{where}: {traceback.format_exc()}"}


def records_of(per_rank: list) -> dict:
    """{case: record} from each rank's {case: record}: rank 0's, or the lowest rank's error record
    where that rank's case raised and rank 0's did not."""
    out = dict(per_rank[0])
    for records in per_rank[1:]:
        for name, record in records.items():
            if _raised(record) and not _raised(out.get(name)):
                out[name] = record
    return out


def passed(record: Any) -> Any:
    """The record of a case that ran in the ranks; one that raised there fails the calling test
    with the rank's traceback as its message (no frame of this helper shown)."""
    if _raised(record):
        import pytest

        pytest.fail(record["error"], pytrace=False)
    return record


def _raised(record: Any) -> bool:
    return isinstance(record, dict) and "error" in record


# [Note: ranks as threads of one process]
# torch's threaded process group (its own tests' `MultiThreadedTestCase`) runs every rank as a
# thread of one process, each thread with its own default group; only state keyed by the process
# group, not by the process, works there. torch ships that backend only in
# `torch.testing._internal.distributed.multi_threaded_pg` (importing it registers the "threaded"
# backend; no public module offers ranks as threads), so this test harness, and nothing in
# framework/, imports it. The threads run in a child process of their own (the threaded world
# replaces c10d's registry for the whole process), which a hang lets the parent kill.


def _rank_thread(threaded, store, rank: int, world_size: int, fn: Callable, args: tuple, results, errors) -> None:
    try:
        dist.init_process_group("threaded", store=store, rank=rank, world_size=world_size)
        try:
            results[rank] = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent; end the other ranks' waits
        errors[rank] = traceback.format_exc()
        threaded.ProcessLocalGroup.exception_handle(None)


def _rank_threads_child(fn: Callable, world_size: int, args: tuple, repeats: int, timeout_s: float, queue: Any) -> None:
    import sys
    import threading

    from torch.testing._internal.distributed import multi_threaded_pg as threaded  # see the note above

    torch.set_num_threads(1)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # group names per thread, as torch's own tests
    threaded._install_threaded_pg()
    outs = []
    try:
        for rep in range(repeats):
            threaded.ProcessLocalGroup.reset()
            store = dist.HashStore()
            results: list = [None] * world_size
            errors: dict = {}

            threads = [
                threading.Thread(
                    target=_rank_thread,
                    args=(threaded, store, r, world_size, fn, args, results, errors),
                    name=f"rank-{r}",
                    daemon=True,
                )
                for r in range(world_size)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            stuck = [t for t in threads if t.is_alive()]
            if stuck:
                frames = sys._current_frames()
                stacks = "".join(
                    f"\n--- {t.name} ---\n" + "".join(traceback.format_stack(frames[t.ident])) for t in stuck
                )
                raised = "".join(f"\n--- rank-{r} raised ---\n{errors[r]}" for r in sorted(errors))
                queue.put(
                    (
                        False,
                        f"run {rep + 1} of {repeats}: {[t.name for t in stuck]} still running after "
                        f"{timeout_s}s:{stacks}{raised}",
                    )
                )
                return
            if errors:
                queue.put((False, f"run {rep + 1} of {repeats}:\n" + "\n".join(errors[r] for r in sorted(errors))))
                return
            outs.append(results)
        queue.put((True, outs))
    except BaseException:  # noqa: BLE001
        queue.put((False, traceback.format_exc()))
    finally:
        queue.close()
        queue.join_thread()  # the report is sent before the process ends
        os._exit(0)  # threads stuck in a collective would keep the process alive


def run_rank_threads(
    fn: Callable, world_size: int, args: tuple = (), repeats: int = 1, timeout_s: float = 60.0
) -> list[list[Any]]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks that are threads of one process
    (torch's threaded process group; [Note: ranks as threads of one process]), `repeats` times in
    a row, each time in a fresh world; returns each run's per-rank results. A run whose ranks do
    not all finish within `timeout_s` raises `TimeoutError` with the stuck threads' stacks; a rank
    that raises, `RanksFailed` with its traceback."""
    ctx = context()
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank_threads_child, args=(fn, world_size, args, repeats, timeout_s, queue), daemon=True)
    proc.start()
    outer = timeout_s * repeats + 60  # the child reports a stuck run itself; this bounds a child that cannot
    try:
        ok, payload = queue.get(timeout=outer)
    except Exception:  # queue.Empty
        raise TimeoutError(f"rank threads reported nothing in {outer}s (exit code {proc.exitcode})") from None
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if not ok:
        if "still running after" in payload:
            raise TimeoutError(payload)
        raise RanksFailed(payload)
    return payload
