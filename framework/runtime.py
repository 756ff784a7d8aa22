"""Process-group setup, starting local ranks when `main.py` is not under torchrun, and saying what
went wrong when a rank fails.

[Note: every failure explained]
A rank that raises prints its rank number and traceback (`run_rank`), records it for torchrun
(`torch.distributed.elastic.multiprocessing.errors.record`: torchrun's summary then shows the root
cause) and exits with `EXIT_CRASH`. Under `python main.py` the ranks are this module's children:
the parent prints every failed rank's traceback once, rank 0 first, identical ones once with all
their ranks, names a rank killed by a signal with the signal, and stops the other ranks a few
seconds after the first failure (they would otherwise wait for the dead one in a collective).

[Note: naming the rank that did not arrive]
Collectives time out after `trainer.collective_timeout_s` (torch's default is 30 minutes). The
rank whose collective timed out then has to say which rank it waited for; gloo's message does not.
Every rank bumps a counter in the job's key-value store every HEARTBEAT_S seconds from a daemon
thread, and records the step it is at. The store is hosted outside the ranks (by the torchrun agent,
or by `spawn_local`'s parent), so it still answers when a rank is stopped or dead: a rank whose
counter does not move over a few heartbeats is stopped or gone; a live rank at an earlier step is
stuck behind the others.

`trainer.collective_timeout_s` is given to `init_process_group`, and every group the framework
makes after it takes the same timeout from the world group ([Note: one timeout for every group] in
framework/distributed/groups.py); the engine's transports take their group's timeout
(`fsdp/host`: the shared-memory channel fails its waiters after it too).

[Note: a hung rank on NCCL]
On gloo (and our shared-memory transport) the rank that waits raises once the timeout passes, and
`report_crash` names the rank that did not arrive. NCCL by default does not raise in the rank: the
host does not wait in `work.wait()` (it only orders the CUDA streams) but later, in a CUDA sync, and
torch's watchdog thread, on finding the collective past its timeout, ends the process itself
(TORCH_NCCL_ASYNC_ERROR_HANDLING's default tears it down): no Python code runs, so no diagnosis.
So a CUDA rank sets TORCH_NCCL_BLOCKING_WAIT=1 before its process group is made: `wait()` then
blocks the host until the collective finished, and one that passes the group's timeout raises
DistBackendError in the rank's own thread (torch documents this for init_process_group's timeout;
with blocking wait its watchdog does not tear the process down). Torch's heartbeat monitor still
ends the process TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes by default) after its own flight
recorder dump; a shorter exported value is raised to NCCL_MONITOR_FLOOR_S so that the diagnosis
(4 heartbeats) comes first. An exported TORCH_NCCL_BLOCKING_WAIT=0 is kept: the host then runs
ahead of NCCL as torch's default does, and a hung rank ends the job without naming it. The cost of
blocking (the host no longer queues kernels past a collective it waits for) and this path itself
have not run on two GPUs; tests/reliability/test_nccl_env.py checks the settings the ranks give.

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
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from framework.errors import EXIT_CRASH

HEARTBEAT_S = 1.0  # see [Note: naming the rank that did not arrive]
NCCL_MONITOR_FLOOR_S = 60  # the least TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: [Note: a hung rank on NCCL]
FAILURE_GRACE_S = 5.0  # how long the other local ranks may take to exit after one failed
_KEY = "framework/heartbeat"


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _store_hosted_outside() -> bool:
    """True when the torchrun agent (or spawn_local's parent) hosts the store, not rank 0."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_distributed(requested_device: str, collective_timeout_s: float = 300.0) -> Runtime:
    """Join the process group described by torchrun's environment (a world of 1 without it).
    Every collective fails after `collective_timeout_s` instead of waiting forever for a rank."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(requested_device, local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        # On GPUs, NCCL for CUDA tensors and gloo beside it for the few CPU ones (a norm over
        # host-offloaded gradients, a stop flag on a CPU rank), as FSDP2 jobs set it up.
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            os.environ.update(nccl_environment(os.environ))
        dist.init_process_group(
            backend,
            store=_job_store(rank, world, timeout),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        if world > 1 and _store_hosted_outside():
            _Heartbeat.start(rank, world)
    return Runtime(rank, world, local_rank, device)


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The TORCH_NCCL_* variables a CUDA rank sets before its process group is made, given the
    environment it inherited: see [Note: a hung rank on NCCL]."""
    if env.get("TORCH_NCCL_BLOCKING_WAIT", "").strip() == "0":
        return {}
    settings = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    monitor = env.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "").strip()
    if monitor and (not monitor.isdigit() or int(monitor) < NCCL_MONITOR_FLOOR_S):
        settings["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(NCCL_MONITOR_FLOOR_S)
    return settings


def _job_store(rank: int, world: int, timeout: datetime.timedelta):
    """The key-value store the process group meets in, with this attempt's keys apart.

    [Note: one store, many attempts]
    torchrun keeps one store for the whole job (its agent hosts it, and with the c10d rendezvous
    the same server serves every restart). The process group publishes each rank's address there
    under fixed keys, so after a restart the new ranks could read the dead ranks' addresses: gloo's
    connectFullMesh then fails with "Connection refused" on every attempt, or a barrier counter left
    over hangs. Every key is therefore prefixed with the attempt's generation, a number every rank
    of the attempt agrees on and no earlier attempt used (`_generation`). torchrun's restart count
    is not one under the c10d rendezvous: an agent whose own ranks were healthy restarts them for
    another node's failure as a membership change, which it does not count, so after one node's
    rank dies the two nodes' counts differ (node 0 at 0, node 1 at 1): the restarted rank 0 read
    the dead rank 1's address under the old prefix and failed, or the ranks waited for each
    other's keys under different prefixes. (The c10d rendezvous's round would do, but the ranks
    cannot see it: it lives in the rendezvous store, not in the one the agent shares with them.)
    So rank 0 draws a new generation from a counter in the store and names it the leader's; every
    other rank reads the leader's generation and joins it (a counter per generation). A rank that
    read an old leader's generation finds it already full (more joins than the world has other
    ranks), or never acknowledged (rank 0 marks its generation once every other rank joined, and
    an old leader died before it could), and reads the leader again until the new rank 0 names
    its own.
    The store waits up to `timeout` for ranks that start late (slow, uneven start-up after a
    restart).
    A world of one process needs no sockets: an in-process store (so the jobs of a sweep, run one
    after the other in one process, never compete for a port)."""
    if world == 1 and "MASTER_PORT" not in os.environ:
        return dist.HashStore()
    addr, port = os.environ.setdefault("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    is_master = rank == 0 and not _store_hosted_outside()
    store = dist.TCPStore(addr, port, world_size=world, is_master=is_master, timeout=timeout, wait_for_workers=False)
    global _attempt
    _attempt = f"generation_{_generation(store, rank, world, timeout)}"
    return dist.PrefixStore(f"framework/{_attempt}/", store)


_attempt = "generation_0"  # this process's attempt, set when it joins: see [Note: one store, many attempts]
_POLL_S = 0.02


def _generation(store, rank: int, world: int, timeout: datetime.timedelta) -> int:
    """The generation of the attempt this rank belongs to: see [Note: one store, many attempts]."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = store.add("framework/generation", 1)
        store.set("framework/leader", str(generation))
        while store.add(f"framework/generation_{generation}/joined", 0) < world - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0: the other ranks did not join generation {generation} in {timeout}")
            time.sleep(_POLL_S)
        store.set(f"framework/generation_{generation}/acknowledged", "1")
        return generation
    tried = joined = None
    while time.monotonic() <= deadline:
        leader = int(store.get("framework/leader")) if store.check(["framework/leader"]) else None
        if leader is not None and leader != tried:
            tried = leader
            if store.add(f"framework/generation_{leader}/joined", 1) <= world - 1:
                joined = leader  # a place in it; an old leader's full generation is skipped
        if joined is not None and store.check([f"framework/generation_{joined}/acknowledged"]):
            return joined
        time.sleep(_POLL_S)
    raise TimeoutError(f"rank {rank}: rank 0 did not start a generation this rank could join in {timeout}")


def shutdown() -> None:
    _Heartbeat.stop()
    # After a crash the peers may be gone or stuck: tearing the group down could hang or abort
    # ("terminate called without an active exception"); the process is about to end anyway. A
    # world of one has no peers: its group goes, so a process that runs jobs one after the other
    # (a sweep, a test session) starts the next one clean after a crash.
    if dist.is_initialized() and (not _crashed or dist.get_world_size() == 1):
        dist.destroy_process_group()


def forget_crash() -> None:
    """A new job in this process starts with no crash reported: an earlier job's crash (in a
    process that runs jobs one after the other) must not change how this one ends."""
    global _crashed
    _crashed = False


def note_step(step: int) -> None:
    """Record this rank's progress for the failure diagnosis (the stop policy calls it per step)."""
    _Heartbeat.step = step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- heartbeats: see [Note: naming the rank that did not arrive] ----


class _Heartbeat:
    step = 0
    _thread: threading.Thread | None = None
    _stop = threading.Event()
    _world = 0

    @classmethod
    def _client(cls, timeout_s: float = 10.0):
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @classmethod
    def start(cls, rank: int, world: int) -> None:
        cls._world = world
        cls._stop.clear()
        store = cls._client()
        attempt = _attempt

        def beat() -> None:
            while not cls._stop.is_set():
                try:
                    store.add(f"{_KEY}/{attempt}/{rank}/alive", 1)
                    store.set(f"{_KEY}/{attempt}/{rank}/step", str(cls.step))
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                    return
                cls._stop.wait(HEARTBEAT_S)

        cls._thread = threading.Thread(target=beat, name="framework-heartbeat", daemon=True)
        cls._thread.start()

    @classmethod
    def stop(cls) -> None:
        """End the heartbeat thread before the process ends: a thread still inside the store's C++
        client when the interpreter exits aborts the process ("terminate called without an active
        exception")."""
        cls._stop.set()
        if cls._thread is not None:
            cls._thread.join(timeout=10)
        cls._thread = None

    @classmethod
    def diagnose(cls, me: int) -> str:
        """Which ranks did not arrive: stopped/dead ones (no heartbeat), else those at an earlier step."""
        if not cls._world:
            return ""
        attempt = _attempt
        try:
            store = cls._client()

            def read():
                alive, steps = {}, {}
                for r in range(cls._world):
                    alive[r] = store.add(f"{_KEY}/{attempt}/{r}/alive", 0)
                    raw = store.get(f"{_KEY}/{attempt}/{r}/step") if alive[r] else b"0"
                    steps[r] = int(raw.decode() or 0)
                return alive, steps

            before, _ = read()
            time.sleep(4 * HEARTBEAT_S)
            after, steps = read()
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the real error
            return f"(could not read the other ranks' heartbeats: {exc})"
        silent = [r for r in range(cls._world) if r != me and after[r] == before[r]]
        if silent:
            return (
                f"rank(s) {', '.join(map(str, silent))} did not arrive: no sign of life for "
                f"{4 * HEARTBEAT_S:.0f} s (stopped, hung in the kernel, or dead)"
            )
        furthest = max(steps.values())
        behind = [r for r in range(cls._world) if steps[r] < furthest]
        if behind:
            return (
                f"rank(s) {', '.join(map(str, behind))} did not arrive: alive but still at step "
                f"{min(steps[r] for r in behind)}, the others at step {furthest}"
            )
        return "every rank is alive and at the same step: one is stuck inside the step"


def _looks_like_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return "timed out" in text or "timeout" in text or isinstance(exc, getattr(dist, "DistError", ()))


# ---- one rank's whole run: see [Note: every failure explained] ----

_report_path: str | None = None  # set in ranks spawn_local started: the parent prints the reports
_crashed = False  # report_crash ran: this process ends with EXIT_CRASH without tearing down torch


def report_crash(exc: BaseException) -> None:
    """Report the exception being handled (call it in an `except` block): its traceback with the
    rank, the ranks a timed-out collective waited for, and torchrun's error file."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    global _crashed
    _crashed = True
    rank = int(os.environ.get("RANK", "0"))
    report = traceback.format_exc()
    if _looks_like_timeout(exc):
        diagnosis = _Heartbeat.diagnose(rank)
        if diagnosis:
            report += f"collective timeout: {diagnosis}\n"
    with contextlib.suppress(Exception):  # torchrun's summary shows this file's traceback
        get_error_handler().record_exception(exc)
    if _report_path:
        with open(_report_path, "w") as f:
            f.write(report)
    else:
        world = os.environ.get("WORLD_SIZE", "1")
        print(f"error: rank {rank} (of {world}) failed:\n{report}", file=sys.stderr, end="", flush=True)


def run_rank(fn: Callable[[Any], int], arg: Any) -> int:
    """`fn(arg)` on this rank, returning its status; an exception is reported (`report_crash`)
    and becomes EXIT_CRASH. A SystemExit passes through with its status."""
    try:
        code = fn(arg) or 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the status says crash
        report_crash(exc)
        code = EXIT_CRASH
    if _crashed:
        # End now, with the crash status: the interpreter's teardown would destroy torch's process
        # group objects with dead peers, which can hang or abort and so change the status.
        sys.stdout.flush()
        sys.stderr.flush()
        from framework.errors import record_status

        record_status(EXIT_CRASH)
        os._exit(EXIT_CRASH)
    return code


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
    # This process's own crash state: a forked rank inherits the parent's, and a parent that reported
    # a crash in-process (a test calling the trainer, a benchmark's earlier job) would otherwise end
    # every rank it forks with EXIT_CRASH after the rank's work succeeded, with no report to say why.
    global _crashed
    _crashed = False
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
    global _report_path
    _report_path = os.path.join(report_dir, f"rank_{local_rank}.txt")
    code = run_rank(fn, arg)
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
) -> list:
    """`fn(rank, world_size, *args)` on `nprocs` local ranks started as `main.py` starts its own
    (`spawn_local`), each in the process group `init_distributed(device)` makes (gloo on CPU; on
    CUDA each rank takes its GPU, NCCL beside gloo); returns each rank's (picklable) result, rank
    0 first. A failure raises `RanksFailed` naming the ranks, with their tracebacks; `timeout_s`:
    ranks still running then are killed and named (None: no limit but the collectives' timeout).
    `fn` is defined at module level (a spawned rank unpickles it). The benchmarks start their
    ranks with this."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory(prefix="run_local-") as out:
        status, report = _start_local(
            _run_and_keep, (fn, args, device, collective_timeout_s, out), nprocs, timeout_s=timeout_s
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
    rt = init_distributed(device, collective_timeout_s)
    result = fn(rt.rank, rt.world_size, *args)
    shutdown()
    with open(os.path.join(out, f"rank_{rt.rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    return 0


def _start_local(fn: Callable[[Any], int], arg: Any, nprocs: int, timeout_s: float | None = None) -> tuple[int, str]:
    """`spawn_local`'s work: the status, and the failure report it prints ("" when none)."""
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
    method = _start_method()
    ctx = multiprocessing.get_context(method)
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
