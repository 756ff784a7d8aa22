"""Start N gloo ranks on this machine, run one picklable function per rank, return the results.

Usage::

    from tests.distributed.harness import run_ranks
    results = run_ranks(my_fn, world_size=2, args=(cfg,), timeout_s=120)
    # results[r] is what my_fn(rank, world_size, *args) returned on rank r

`my_fn` must be defined at module level (it is pickled for the child processes). The process
group is initialised before `my_fn` runs and destroyed after. A failure on any rank raises
`RankFailure` here with that rank's traceback (several cases in one spawn: see `recorded`); a
rank that does not finish within `timeout_s` makes every rank get killed and `TimeoutError`
raised, so a deadlocked collective never hangs the test suite. Each rank runs with one compute
thread (as torchrun does) so gloo's communication threads get a core.

The backend is gloo unless `TEST_DIST_BACKEND` says otherwise when `run_ranks` is called (e.g.
`cpu:gloo,cuda:nccl` on a GPU machine: CPU tensors still use gloo, CUDA tensors NCCL); with a
CUDA backend each rank takes GPU `rank % device_count` as its current device.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from framework.profiling import peak_delta_bytes  # noqa: F401 - the tests' peak reader, the benchmarks' too


class RankFailure(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _child(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, threads: int, backend: str = "gloo"
) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)  # the parent hosts it
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))


# Imported once by the fork server, so each rank starts with them instead of importing torch anew.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # ~1.7 s: the engine's hooks import it (torch.compiler.disable), so does a meta fill
    "framework.distributed",
    "framework.distributed.fsdp",
    "framework.models",
    "framework.trainer",
]


def _context():
    """Ranks come from a fork server: a clean process (it never ran autograd or opened a process
    group, unlike this test process) that imports torch and the engine once and forks every rank
    of every test from there; a spawned rank would import them again (seconds per rank)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results."""
    ctx = _context()
    queue = ctx.Queue()
    # The store on a port the kernel picks and keeps: no other test process can take it meanwhile
    # (a port found free and released could be, with pytest-xdist workers beside this one).
    host = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = host.port
    backend = os.environ.get("TEST_DIST_BACKEND", "gloo")
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue, threads_per_rank, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(results))} did not finish in {timeout_s}s"
                )
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty: check for ranks that died without reporting
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    raise RankFailure(f"rank(s) {dead} died with exit codes {codes}") from None
                continue
            if not ok:
                raise RankFailure(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5 if len(results) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results[r] for r in range(world_size)]


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
    that raises, `RankFailure` with its traceback."""
    ctx = _context()
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
        raise RankFailure(payload)
    return payload
