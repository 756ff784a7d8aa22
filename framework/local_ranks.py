"""Starting this machine's ranks: `python main.py` without torchrun (`spawn_local`), and the tests'
and benchmarks' jobs (`run_local`), each rank a child of this process with the process group's store
hosted here. Every failure is printed once, by rank ([Note: every failure explained] in
framework/runtime.py, which holds what runs inside each rank).

[Note: local ranks are forked on CPU builds]
`python main.py` has imported torch and the framework by the time it starts its ranks. A spawned
rank imports them again (about 5 s of every job's start on two cores); a forked one has them. So
on a torch build without CUDA or ROCm the ranks are forked, before the parent starts the store's
threads (its port reaches them through a pipe), and each resets the parent's signal forwarder. A
CUDA build spawns them: the parent may have asked the driver about devices (config validation),
and CUDA does not survive a fork. `FRAMEWORK_RANK_START=spawn|fork` chooses by hand (the tests run
the spawn path on CPU with it).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from framework import runtime
from framework.errors import EXIT_CRASH

FAILURE_GRACE_S = 5.0  # how long the other local ranks may take to exit after one failed


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (no orphan ranks)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _start_method() -> str:
    """How spawn_local starts its ranks: see [Note: local ranks are forked on CPU builds]."""
    chosen = os.environ.get("FRAMEWORK_RANK_START", "")
    if chosen in ("fork", "spawn"):
        return chosen
    accelerated = torch.backends.cuda.is_built() or torch.version.hip is not None
    return "spawn" if accelerated else "fork"


def _read_port(fd: int) -> int:
    """The store's port, written by the parent once every rank is forked (8 bytes per rank)."""
    raw = b""
    while len(raw) < 8:
        chunk = os.read(fd, 8 - len(raw))
        if not chunk:
            raise RuntimeError("the launching process ended before it gave the ranks the store's port")
        raw += chunk
    os.close(fd)
    return int(raw)


def _local_rank_entry(
    local_rank: int, fn: Callable[[Any], int], arg: Any, nprocs: int, port: int | tuple, report_dir: str
) -> None:
    _die_with_parent()
    runtime.begin_local_rank(os.path.join(report_dir, f"rank_{local_rank}.txt"))
    if isinstance(port, tuple):  # forked: the parent's signal forwarder came along; the port comes by pipe
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
        read_fd, write_fd = port
        os.close(write_fd)
        port = _read_port(read_fd)
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )  # the parent hosts the store
    # As torchrun does: one compute thread per rank unless the user says otherwise, so the ranks
    # (and the communication threads) do not oversubscribe the cores.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    code = runtime.run_rank(fn, arg)
    # The rank's work is written and closed (the trainer's `finally`, the process group's
    # shutdown): end without the interpreter's teardown, which unloads torch for a second or more.
    # multiprocessing's own exit handler still runs (it releases the semaphores a data library
    # made, which its resource tracker would otherwise report as leaked).
    import multiprocessing.util

    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def spawn_local(fn: Callable[[Any], int], arg: Any, nprocs: int) -> int:
    """Run `fn(arg)` on `nprocs` local ranks; return the status of the first rank that failed (0 if
    none), having printed every failure. See [Note: every failure explained].

    SIGTERM and SIGUSR1 sent to this process (a scheduler's pre-emption notice, `kill`) are passed
    on to every rank, which stop after the current step (saving a checkpoint if checkpoints are on)
    and exit with the requeue status.
    """
    status, report = _start_local(fn, arg, nprocs)
    if report:
        print(report, file=sys.stderr, flush=True)
    return status


class RanksFailed(RuntimeError):
    """A rank of `run_local` failed or did not finish in time; the message is the report
    `spawn_local` prints: each failed rank's traceback, a rank killed by a signal, a rank stopped."""


def run_local(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    device: str = "cpu",
    timeout_s: float | None = None,
    collective_timeout_s: float = 300.0,
    start: str | None = None,
    preload: Sequence[str] = (),
) -> list:
    """`fn(rank, world_size, *args)` on `nprocs` local ranks started as `main.py` starts its own
    (`spawn_local`), each in the process group `init_distributed(device)` makes (gloo on CPU; on
    CUDA each rank takes its GPU, NCCL beside gloo); returns each rank's (picklable) result, rank
    0 first. A failure raises `RanksFailed` naming the ranks, with their tracebacks; `timeout_s`:
    ranks still running then are killed and named (None: no limit but the collectives' timeout).
    `fn` is defined at module level (a spawned rank unpickles it). The benchmarks and the tests
    start their ranks with this.

    `start`: how the ranks start, "fork", "spawn" or "forkserver" (None: as `spawn_local` chooses,
    [Note: local ranks are forked on CPU builds]). "forkserver" forks every rank from one clean
    process per parent that imported `preload` once, before its first rank: a parent that ran
    autograd or held process groups (a test process) passes neither to its ranks, and the ranks
    import nothing again (the tests start a few hundred jobs). Such ranks are the server's children:
    they die with it (`_die_with_parent`), and it ends with this process."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory(prefix="run_local-") as out:
        status, report = _start_local(
            _run_and_keep,
            (fn, args, device, collective_timeout_s, out),
            nprocs,
            timeout_s=timeout_s,
            start=start,
            preload=preload,
        )
        if status:
            raise RanksFailed(report or f"the ranks ended with status {status}")
        results = []
        for rank in range(nprocs):
            with open(os.path.join(out, f"rank_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _run_and_keep(arg: tuple) -> int:
    """One rank of `run_local`: join the process group, run, keep the result for the parent."""
    import pickle

    fn, args, device, collective_timeout_s, out = arg
    rt = runtime.init_distributed(device, collective_timeout_s)
    result = fn(rt.rank, rt.world_size, *args)
    runtime.shutdown()
    with open(os.path.join(out, f"rank_{rt.rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    return 0


def _start_local(
    fn: Callable[[Any], int],
    arg: Any,
    nprocs: int,
    timeout_s: float | None = None,
    start: str | None = None,
    preload: Sequence[str] = (),
) -> tuple[int, str]:
    """`spawn_local`'s work: the status, and the failure report it prints ("" when none); `start`
    and `preload` as `run_local` takes them."""
    import multiprocessing
    import tempfile

    from framework.fileio import RANKS_PREFIX, owner_tag, sweep_leftovers

    def host_store():
        return dist.TCPStore(
            "127.0.0.1",
            0,
            world_size=nprocs,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=600),
        )

    sweep_leftovers()  # what killed jobs on this host left behind
    report_dir = tempfile.mkdtemp(prefix=f"{RANKS_PREFIX}{owner_tag()}-")
    method = start or _start_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(preload))  # read when this process's server starts
    store, port_pipe = None, None
    if method == "fork":
        port_pipe = os.pipe()  # the store's threads start after the fork: its port goes through here
    else:
        store = host_store()
    procs = [
        ctx.Process(
            target=_local_rank_entry,
            args=(r, fn, arg, nprocs, port_pipe or store.port, report_dir),
            name=f"rank{r}",
        )
        for r in range(nprocs)
    ]

    def forward(signum, _frame):
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    first: tuple[int, int] | None = None  # (rank, exit code) of the first rank that ended badly
    stopped: list[int] = []
    try:
        # [Note: forked ranks never collect what they inherit] A forked rank holds a copy of every
        # object of this process, garbage included: a TCPStore left in a reference cycle by an
        # earlier job run in this process, say. Collected in the rank, its destructor joins the
        # store's thread, which a fork does not copy, and the rank hangs for good. Frozen objects
        # are never collected, so the ranks start with everything inherited frozen.
        gc.freeze()
        try:
            for p in procs:
                p.start()
        finally:
            gc.unfreeze()
        if port_pipe is not None:
            store = host_store()
            os.close(port_pipe[0])
            os.write(port_pipe[1], f"{store.port:08d}".encode() * nprocs)  # atomic: under PIPE_BUF
            os.close(port_pipe[1])
        failed_at = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(p.exitcode is None for p in procs):
            for p in procs:
                p.join(timeout=0.1)
            for r, p in enumerate(procs):
                if first is None and p.exitcode not in (None, 0):
                    first, failed_at = (r, p.exitcode), time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                for r, p in enumerate(procs):
                    if p.exitcode is None:
                        stopped.append(r)
                        p.kill()
                        p.join()
            if deadline is not None and time.monotonic() > deadline:
                late = [r for r, p in enumerate(procs) if p.exitcode is None]
                for r in late:
                    procs[r].kill()
                    procs[r].join()
                overdue = f"error: rank(s) {', '.join(map(str, late))} did not finish within {timeout_s:g} s"
                return EXIT_CRASH, "\n".join(filter(None, [_failure_report(procs, None, late, report_dir), overdue]))
        report = _failure_report(procs, first, stopped, report_dir)
    except BaseException:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                p.kill()
                p.join()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        import shutil

        shutil.rmtree(report_dir, ignore_errors=True)
    del store
    if first is None:
        return 0, report
    return (first[1] if first[1] > 0 else EXIT_CRASH), report


def _print_failures(procs, first, stopped: list[int], report_dir: str) -> None:
    """Every failed rank's traceback, rank 0 first, identical ones once; signals named."""
    report = _failure_report(procs, first, stopped, report_dir)
    if report:
        print(report, file=sys.stderr, flush=True)


def _failure_report(procs, first, stopped: list[int], report_dir: str) -> str:
    """What `_print_failures` prints ("" when every rank ended well)."""
    lines: list[str] = []
    reports: dict[str, list[int]] = {}
    for r, p in enumerate(procs):
        path = os.path.join(report_dir, f"rank_{r}.txt")
        if os.path.isfile(path):
            with open(path) as f:
                reports.setdefault(f.read(), []).append(r)
        elif r in stopped:
            pass
        elif p.exitcode is not None and p.exitcode < 0:
            name = signal.Signals(-p.exitcode).name
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
            lines.append(f"error: rank {r} was killed by signal {name}{hint}")
    for text, ranks in reports.items():  # dicts keep insertion order: lowest rank first
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        lines.append(f"error: {who} (of {len(procs)}) failed:\n{text.rstrip()}")
    if stopped and first is not None:
        lines.append(
            f"error: stopped rank(s) {', '.join(map(str, stopped))}: still running "
            f"{FAILURE_GRACE_S:.0f} s after rank {first[0]} ended with status {first[1]}"
        )
    return "\n".join(lines)
