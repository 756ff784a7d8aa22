"""A shared-memory transport for the all-gathers and reduce-scatters of ranks on one host.

[Note: shared-memory collectives on one host]
gloo carries every byte over TCP loopback: about 1 GB/s on our CPU machines, and the kernel's
copies take CPU time from the ranks' own compute. When every rank of a process group is a process
on the same host, the engine instead passes its all-gathers and reduce-scatters through one
shared-memory segment per group (`open_shared_memory` decides, collectively, and the group keeps
gloo otherwise):

- The segment holds one arrival counter per rank (each on its own cache line) and two slots, each
  with one region of `region_bytes` per rank. A collective moves in chunks of at most one region.
- For each chunk a rank copies its part into its own region of the next slot, raises its counter
  to the chunk's sequence number, waits until every rank's counter has reached it, then reads the
  other ranks' regions: copied out for an all-gather, or added to its own chunk for a
  reduce-scatter (its own chunk first, then the others in rank order).
- Slots alternate. A rank writes slot k % 2 only after all ranks arrived at chunk k - 1, and a rank
  arrives at k - 1 only after it finished reading chunk k - 2, the slot's previous use. So one
  arrival per chunk is the only synchronisation, and no rank overwrites data another still reads.
- One worker thread per segment runs the collectives in the order they were issued, so `wait()`
  has the same meaning as gloo's: the engine issues, computes, then waits.

The counters need no locks on x86-64: its stores are seen by other cores in program order (the
data before the counter), and its loads are not moved before an earlier load (the counter before
the data). Other architectures order memory more weakly; there the engine keeps gloo
(`supported()`). A rank that finds another behind sleeps in the kernel on that rank's counter
(a futex, which the arriving rank wakes): on a host with as many ranks as cores, a waiter that
spun would take the core from its own rank's compute.

The segment's file is unlinked as soon as every rank has mapped it, so nothing is left in
/dev/shm after the processes end, however they end. A rank that has not arrived within
`timeout_s` fails the collective with a timeout naming the ranks that were missing (a rank that is
alive but stopped or stuck: its process id still exists); one whose process has exited fails it
within about a second (each rank's process id is in the segment). `open_shared_memory` gives the
channel its process group's own timeout (`trainer.collective_timeout_s`), so a hung rank ends the
job after the same time on this transport as on gloo or NCCL.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import queue
import socket
import threading
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from framework.fileio import SHM_PREFIX, pid_namespace, sweep_dead

from ..transport import Transport
from ..tree import tree_sum

SHM_DIR = "/dev/shm"
REGION_BYTES = 4 << 20  # per rank and slot; 1, 2, 4, 8 and 16 MiB measured (bench/RESULTS.md)
_LINE = 64  # bytes between two ranks' counters (one cache line each)
_PAGE = 4096  # the slots start on a page boundary, after the counters


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the waiters are other processes
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_TENTH_SECOND = _Timespec(0, 100_000_000)


def _futex(address: int, op: int, value: int, timeout: "_Timespec | None" = None) -> None:
    """FUTEX_WAIT: sleep while the 32-bit word at `address` equals `value`; FUTEX_WAKE: wake its
    sleepers. ctypes lets go of the GIL for the call."""
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        ctypes.c_int(op),
        ctypes.c_int(value),
        ctypes.byref(timeout) if timeout is not None else None,
        None,
        ctypes.c_int(0),
    )


def _alive(pid: int) -> bool:
    """Whether process `pid` (a rank on this host; 0: not yet known) still exists."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, under another user
    return True


def supported() -> bool:
    """Whether this host can run the transport: Linux on x86-64 with a tmpfs /dev/shm."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


class SharedMemoryError(RuntimeError):
    """A collective on the shared-memory transport failed: a rank exited, or did not arrive in time."""


class _Work:
    """The handle of an issued collective, with the `wait()` of torch.distributed's Work."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


def _header_bytes(world: int) -> int:
    return -(-world * _LINE // _PAGE) * _PAGE


def segment_bytes(world: int, region_bytes: Optional[int] = None) -> int:
    return _header_bytes(world) + 2 * world * (region_bytes or REGION_BYTES)


class SharedMemoryChannel:
    """One process group's segment and worker (see [Note: shared-memory collectives on one host]).

    Rank 0 of the group calls `create`, then (after every rank knows it exists) the others call
    `attach`; once all have it mapped, rank 0 calls `unlink`.
    """

    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        create: bool,
        region_bytes: int,
        timeout_s: float,
        global_ranks: Optional[list] = None,
    ) -> None:
        if region_bytes % 4096:
            raise ValueError(f"region_bytes={region_bytes}: use a multiple of 4096")
        self.path, self.rank, self.world = path, rank, world
        # the job's rank numbers of this group's ranks, for the messages (default: the same)
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world))
        self.region_bytes, self.timeout_s = region_bytes, timeout_s
        size = segment_bytes(world, region_bytes)
        self._slots_at = _header_bytes(world)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                # reserve every page now: a /dev/shm too small for the segment (a container's
                # default is 64 MiB) fails here, and the group stays on gloo, instead of a SIGBUS
                # at the first write past the end of the space
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.unlink(path)
                    raise
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        # one cache line per rank: its arrival counter (a 32-bit futex word), then its process id
        header = np.frombuffer(self._map, dtype=np.int32, count=world * _LINE // 4)
        self._counters = header[:: _LINE // 4]
        self._pids = header[1 :: _LINE // 4]
        self._pids[rank] = os.getpid()
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._seq = 0
        self._broken: Optional[BaseException] = None
        self._jobs: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"shm-collectives-{rank}", daemon=True)
        self._thread.start()

    @classmethod
    def create(
        cls, path: str, rank: int, world: int, region_bytes: Optional[int] = None, timeout_s: float = 1800.0, **kw
    ):
        return cls(path, rank, world, True, region_bytes or REGION_BYTES, timeout_s, **kw)

    @classmethod
    def attach(
        cls, path: str, rank: int, world: int, region_bytes: Optional[int] = None, timeout_s: float = 1800.0, **kw
    ):
        return cls(path, rank, world, False, region_bytes or REGION_BYTES, timeout_s, **kw)

    def unlink(self) -> None:
        os.unlink(self.path)

    def close(self) -> None:
        """Stop the worker once the collectives issued so far are done (the mapping goes with the object)."""
        self._jobs.put(None)

    # ------------------------------------------------------------------ issuing
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> _Work:
        """Gather equal flat `shard`s into flat `output` (rank-major), this rank's own part too
        (on the worker, so the issuing thread goes straight back to compute)."""
        return self._issue(self._all_gather, output, shard)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> _Work:
        """Sum the ranks' flat `full` (rank-major chunks) and keep this rank's chunk in `output`."""
        return self._issue(self._reduce_scatter, output, full)

    def tree_reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> _Work:
        """`reduce_scatter` with the ranks' chunks added in the canonical tree's order (rank i is
        leaf i; `canonical.tree_sum`): the deterministic mode's reduction."""
        return self._issue(self._tree_reduce_scatter, output, full)

    def _issue(self, fn: Callable, *args) -> _Work:
        work = _Work()
        self._jobs.put((work, fn, args))
        return work

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            work, fn, args = job
            try:
                if self._broken is not None:
                    raise SharedMemoryError(f"an earlier collective on this group failed: {self._broken}")
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self._broken = self._broken or e
                work._error = e
            del job, fn, args  # hold no buffer of the engine's past its collective
            work._done.set()
            del work

    # ------------------------------------------------------------------ the chunk protocol
    def _region(self, slot: int, rank: int, dtype: torch.dtype, numel: int, at: int = 0) -> torch.Tensor:
        start = self._slots_at + (slot * self.world + rank) * self.region_bytes + at
        return self._bytes[start : start + numel * dtype.itemsize].view(dtype)

    def _next_slot(self) -> int:
        """The slot the next chunk goes through (chunks alternate between the two)."""
        return (self._seq + 1) % 2

    def _arrive_and_wait(self) -> None:
        """Raise this rank's counter to the next chunk and wait for every rank's.

        A rank behind is waited for in the kernel (a futex on its counter, woken by its arrival),
        not by spinning: a spinning waiter would take the core from this rank's own compute."""
        self._seq += 1
        seq = self._seq
        counters = self._counters
        counters[self.rank] = seq
        _futex(self._counter_address(self.rank), _FUTEX_WAKE, _WAKE_ALL)
        deadline = None
        for j in range(self.world):
            spins = 0
            while True:
                seen = int(counters[j])
                if seen >= seq:
                    break
                spins += 1
                if spins < 50:  # a rank just behind: a few microseconds
                    continue
                # sleeps until rank j's counter is no longer `seen` (or 0.1 s passes)
                _futex(self._counter_address(j), _FUTEX_WAIT, seen, _TENTH_SECOND)
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if spins % 10 == 0 and not _alive(int(self._pids[j])):
                    raise SharedMemoryError(
                        f"rank {self.global_ranks[self.rank]}: rank {self.global_ranks[j]} of this group "
                        f"(process {int(self._pids[j])}) exited before chunk {seq} of the shared-memory "
                        "collectives"
                    )
                if now > deadline:
                    missing = [self.global_ranks[i] for i in range(self.world) if counters[i] < seq]
                    raise SharedMemoryError(
                        f"rank {self.global_ranks[self.rank]}: collective timed out after {self.timeout_s:g} s: "
                        f"rank(s) {missing} of this group did not reach chunk {seq} of the shared-memory "
                        "collectives (stopped, stuck, or issuing other collectives)"
                    )

    def _counter_address(self, rank: int) -> int:
        return self._base + rank * _LINE

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> None:
        n, r = self.world, self.rank
        S, dtype = shard.numel(), shard.dtype
        own = output[r * S : (r + 1) * S]
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        per = self.region_bytes // dtype.itemsize
        for off in range(0, S, per):
            k = min(per, S - off)
            slot = self._next_slot()
            self._region(slot, r, dtype, k).copy_(shard[off : off + k])
            self._arrive_and_wait()
            for j in range(n):
                if j != r:
                    output[j * S + off : j * S + off + k].copy_(self._region(slot, j, dtype, k))

    def _posted_chunks(self, output: torch.Tensor, full: torch.Tensor):
        """The reduce-scatter's chunk protocol: per chunk of this rank's output, every other rank's
        part posted to this rank's region, then all arrive; yields (offset, length, this rank's own
        part, the others' parts in rank order with None at this rank's place)."""
        n, r = self.world, self.rank
        S, dtype = output.numel(), full.dtype
        per = self.region_bytes // (n * dtype.itemsize)  # a region holds one sub-chunk per rank
        for off in range(0, S, per):
            k = min(per, S - off)
            slot = self._next_slot()
            for j in range(n):
                if j != r:
                    part = full[j * S + off : j * S + off + k]
                    self._region(slot, r, dtype, k, at=j * k * dtype.itemsize).copy_(part)
            self._arrive_and_wait()
            at = r * k * dtype.itemsize
            parts = [None if j == r else self._region(slot, j, dtype, k, at=at) for j in range(n)]
            yield off, k, full[r * S + off : r * S + off + k], parts

    def _reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        for off, k, own, parts in self._posted_chunks(output, full):
            out = output[off : off + k]  # may be `own` itself: it is read before it is written
            others = [p for p in parts if p is not None]
            torch.add(own, others[0], out=out)
            for p in others[1:]:
                out.add_(p)

    def _tree_reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> None:
        # each element's sum is the tree's over the ranks, read straight from the regions (the sum
        # is elementwise, so chunking leaves its bits alone)
        for off, k, own, parts in self._posted_chunks(output, full):
            tree_sum([own if p is None else p for p in parts], out=output[off : off + k])


class SharedMemoryTransport(Transport):
    """A group's all-gathers and reduce-scatters through its `SharedMemoryChannel`."""

    name = "shm"

    def __init__(self, group, channel: SharedMemoryChannel) -> None:
        super().__init__(group)
        self.channel = channel

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> _Work:
        return self.channel.all_gather(output, shard)

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, scratch=None):
        return self.channel.reduce_scatter(output, full), None

    def tree_reduce_scatter(self, output: torch.Tensor, full: torch.Tensor):
        return self.channel.tree_reduce_scatter(output, full), None

    def close(self) -> None:
        self.channel.close()


def host_key() -> int:
    """This host's identity as a number: the hostname, the kernel's boot id and the process-id
    namespace (the transport checks its peers' process ids, which must mean the same process)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        boot = pid_ns = ""
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}/{pid_ns}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


def open_shared_memory(group, timeout_s: float) -> Optional[SharedMemoryTransport]:
    """Collective over the gloo `group`: its shared-memory transport, whose collectives fail after
    `timeout_s` (the group's own timeout), or None on every rank where a rank is on another host,
    cannot run it, or the segment cannot be made or mapped."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    opts = dict(timeout_s=timeout_s, global_ranks=dist.get_process_group_ranks(group))
    token = int.from_bytes(os.urandom(7), "little")
    mine = torch.tensor([host_key(), int(supported()), token, os.getpid()], dtype=torch.int64)
    seen = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(seen, mine, group=group)
    if not all(int(t[1]) for t in seen) or len({int(t[0]) for t in seen}) != 1:
        return None
    if r == 0:
        sweep_dead(SHM_DIR, SHM_PREFIX)  # segments of killed jobs (see [Note: leftovers of killed jobs])
    path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{pid_namespace()}-{int(seen[0][3])}-{int(seen[0][2]):014x}")  # rank 0's
    channel, ok = None, torch.ones(1, dtype=torch.int64)
    try:
        if r == 0:
            try:
                channel = SharedMemoryChannel.create(path, r, n, **opts)
            except OSError:
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # rank 0 has made it: the others map it
        if r != 0 and int(ok):
            try:
                channel = SharedMemoryChannel.attach(path, r, n, **opts)
            except OSError:
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has it mapped, or none uses it
    finally:
        if r == 0 and channel is not None:
            channel.unlink()  # nothing stays in /dev/shm, however the processes end
    if not int(ok):
        if channel is not None:
            channel.close()
        return None
    return SharedMemoryTransport(group, channel)
