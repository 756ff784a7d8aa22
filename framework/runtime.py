"""One rank's runtime: joining the process group, the heartbeat that names a rank that did not
arrive, and saying what went wrong when the rank fails. Starting local ranks (`python main.py`
without torchrun, the tests, the benchmarks) is framework/local_ranks.py's.

[Note: every failure explained]
A rank that raises prints its rank number and traceback (`run_rank`), records it for torchrun
(`torch.distributed.elastic.multiprocessing.errors.record`: torchrun's summary then shows the root
cause) and exits with `EXIT_CRASH`. Under `python main.py` the ranks are children of `local_ranks.spawn_local`:
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
"""

from __future__ import annotations

import contextlib
import datetime
import os
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
_KEY = "framework/heartbeat"
_POLL_S = 0.02


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class _ThisRank:
    """What this process knows about itself as a rank, and may change while it runs: the module's
    only mutable state (one instance, `_this`). Set by `init_distributed` (the attempt, the
    heartbeat), `note_step`, `report_crash`, and by the local starter in a rank it started
    (`begin_local_rank`)."""

    def __init__(self) -> None:
        self.attempt = "generation_0"  # set when it joins: see [Note: one store, many attempts]
        self.step = 0  # the step it is at, for the heartbeat
        self.heartbeat: _Heartbeat | None = None  # kept after it stops: a crash report reads it
        self.report_path: str | None = None  # set in ranks a local starter started: its parent prints
        self.crashed = False  # report_crash ran: the process ends with EXIT_CRASH, torch not torn down


_this = _ThisRank()


def attempt() -> str:
    """The attempt this process's rank met in (`generation_<n>`): [Note: one store, many attempts]."""
    return _this.attempt


def begin_local_rank(report_path: str) -> None:
    """Called first in a rank a local starter started: its crash report goes to `report_path` (the
    parent prints it), and its crash state is its own (a forked rank inherits the parent's: a parent
    that reported a crash in-process, a test calling the trainer or a benchmark's earlier job, would
    otherwise end every rank it forks with EXIT_CRASH after the rank's work succeeded, with no
    report to say why)."""
    _this.report_path = report_path
    _this.crashed = False


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _store_hosted_outside() -> bool:
    """True when the torchrun agent (or a local starter's parent) hosts the store, not rank 0."""
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
            _this.heartbeat = _Heartbeat(rank, world, _this.attempt)
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
    _this.attempt = f"generation_{_generation(store, rank, world, timeout)}"
    return dist.PrefixStore(f"framework/{_this.attempt}/", store)


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
    if _this.heartbeat is not None:
        _this.heartbeat.stop()
    # After a crash the peers may be gone or stuck: tearing the group down could hang or abort
    # ("terminate called without an active exception"); the process is about to end anyway. A
    # world of one has no peers: its group goes, so a process that runs jobs one after the other
    # (a sweep, a test session) starts the next one clean after a crash.
    if dist.is_initialized() and (not _this.crashed or dist.get_world_size() == 1):
        dist.destroy_process_group()


def forget_crash() -> None:
    """A new job in this process starts with no crash reported: an earlier job's crash (in a
    process that runs jobs one after the other) must not change how this one ends."""
    _this.crashed = False


def note_step(step: int) -> None:
    """Record this rank's progress for the failure diagnosis (the stop policy calls it per step)."""
    _this.step = step


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- heartbeats: see [Note: naming the rank that did not arrive] ----


def _store_client(timeout_s: float = 10.0):
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class _Heartbeat:
    """This rank's heartbeat thread in attempt `attempt`'s keys (started on construction), and the
    diagnosis that reads every rank's."""

    def __init__(self, rank: int, world: int, attempt: str) -> None:
        self.world, self.attempt = world, attempt
        self._stop = threading.Event()
        store = _store_client()

        def beat() -> None:
            while not self._stop.is_set():
                try:
                    store.add(f"{_KEY}/{attempt}/{rank}/alive", 1)
                    store.set(f"{_KEY}/{attempt}/{rank}/step", str(_this.step))
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                    return
                self._stop.wait(HEARTBEAT_S)

        self._thread: threading.Thread | None = threading.Thread(target=beat, name="framework-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the heartbeat thread before the process ends: a thread still inside the store's C++
        client when the interpreter exits aborts the process ("terminate called without an active
        exception")."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    def diagnose(self, me: int) -> str:
        """Which ranks did not arrive: stopped/dead ones (no heartbeat), else those at an earlier step."""
        world, attempt = self.world, self.attempt
        try:
            store = _store_client()

            def read():
                alive, steps = {}, {}
                for r in range(world):
                    alive[r] = store.add(f"{_KEY}/{attempt}/{r}/alive", 0)
                    raw = store.get(f"{_KEY}/{attempt}/{r}/step") if alive[r] else b"0"
                    steps[r] = int(raw.decode() or 0)
                return alive, steps

            before, _ = read()
            time.sleep(4 * HEARTBEAT_S)
            after, steps = read()
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the real error
            return f"(could not read the other ranks' heartbeats: {exc})"
        silent = [r for r in range(world) if r != me and after[r] == before[r]]
        if silent:
            return (
                f"rank(s) {', '.join(map(str, silent))} did not arrive: no sign of life for "
                f"{4 * HEARTBEAT_S:.0f} s (stopped, hung in the kernel, or dead)"
            )
        furthest = max(steps.values())
        behind = [r for r in range(world) if steps[r] < furthest]
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


def report_crash(exc: BaseException) -> None:
    """Report the exception being handled (call it in an `except` block): its traceback with the
    rank, the ranks a timed-out collective waited for, and torchrun's error file."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    _this.crashed = True
    rank = int(os.environ.get("RANK", "0"))
    report = traceback.format_exc()
    if _looks_like_timeout(exc) and _this.heartbeat is not None:
        diagnosis = _this.heartbeat.diagnose(rank)
        if diagnosis:
            report += f"collective timeout: {diagnosis}\n"
    with contextlib.suppress(Exception):  # torchrun's summary shows this file's traceback
        get_error_handler().record_exception(exc)
    if _this.report_path:
        with open(_this.report_path, "w") as f:
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
    if _this.crashed:
        # End now, with the crash status: the interpreter's teardown would destroy torch's process
        # group objects with dead peers, which can hang or abort and so change the status.
        sys.stdout.flush()
        sys.stderr.flush()
        from framework.errors import record_status

        record_status(EXIT_CRASH)
        os._exit(EXIT_CRASH)
    return code
