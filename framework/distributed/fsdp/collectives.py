"""Every collective of the engine, as free functions over an explicit process group.

Each issuing function returns a small NamedTuple holding the work handle and the buffers it
writes; `wait()` on it is the only place the engine blocks on communication, and it adds the time
spent blocked to `CommStats.exposed_comm_s` (the exposed-communication counter, see
ENGINE_NOTES.md section 4). Byte counters follow the theory of section 5: an all-gather counts the
bytes this rank *receives* ((N-1) x shard bytes), a reduce-scatter or all-to-all the bytes it
*sends* ((N-1) x shard bytes), an all-reduce the ring volume 2 (N-1)/N x tensor bytes.

gloo in this torch deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single`; we use the latter on other backends (NCCL), and the
former where a torch has not got the new names yet (the same calls under their older names).

[Note: gloo collectives built from in-place primitives]
On gloo, `all_gather_single` gathers into a temporary and copies every chunk out, and
`reduce_scatter_single` clones the whole input, all-reduces it (twice the reduce-scatter traffic)
and copies the chunk out: two full-size copies and a full-size allocation per call (seen in the
profiler as aten::copy_ of unit size). On gloo we therefore build them from primitives that work
in place: the all-gather is one broadcast per rank straight into its slice of the output (only
this rank's own shard is copied in), and the reduce-scatter is an all-to-all that sends every
other rank its chunk and receives theirs, summed locally into the output (traffic (N-1) x shard,
as the theory says). Both still count as ONE collective in `num_collectives` (logical ops).

Where every rank of a gloo group runs on this host, all-gathers and reduce-scatters go through
shared memory instead ([Note: shared-memory collectives on one host] in shm.py): decided once per
group, by a small collective before the group's first all-gather or reduce-scatter, so every rank
of the group takes the same transport. `set_host_transport("gloo")` turns it off. The byte
counters are the same on either transport: they count what the collective moves, not how.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from framework.distributed.fsdp import shm


@dataclass
class CommStats:
    """Counters of one unit; `comm_stats()` on a module sums them over its units."""

    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    allreduce_bytes: int = 0
    alltoall_bytes: int = 0
    num_collectives: int = 0
    exposed_comm_s: float = 0.0
    # CUDA: (before, after) events around each wait on the compute stream, read by resolve()
    _events: List[Tuple[Any, Any]] = field(default_factory=list, repr=False)

    def reset(self) -> None:
        self.resolve()
        self.allgather_bytes = self.reduce_scatter_bytes = self.allreduce_bytes = 0
        self.alltoall_bytes = self.num_collectives = 0
        self.exposed_comm_s = 0.0

    def resolve(self) -> None:
        """Add the timed CUDA waits to exposed_comm_s (synchronizes on the last of them)."""
        for before, after in self._events:
            after.synchronize()
            self.exposed_comm_s += before.elapsed_time(after) / 1000.0
        self._events.clear()


class Pending(NamedTuple):
    """An issued collective: wait on `work`, then read `output`."""

    work: Any  # dist.Work, a list of them, or None when there is nothing to wait for
    output: torch.Tensor
    stats: CommStats
    finish: Optional[Callable[[], None]] = None  # local work after the wait (e.g. summing chunks)


def wait(p: Optional[Pending]) -> Optional[torch.Tensor]:
    """Block until `p` is done; the blocked time counts as exposed communication.

    On gloo (CPU) the host blocks in `work.wait()`: that time is measured on the host clock. On
    CUDA `work.wait()` only makes the compute stream wait for the communication stream and
    returns at once; what is exposed is the time the *stream* stalls, so it is timed with a pair
    of CUDA events around the wait, read later by `CommStats.resolve()` (so timing never
    synchronizes the step).
    """
    if p is None:
        return None
    if p.work is not None:
        with record_function("fsdp::wait"):
            cuda = p.output.is_cuda
            if cuda:
                before = torch.cuda.Event(enable_timing=True)
                after = torch.cuda.Event(enable_timing=True)
                before.record()
            t0 = time.perf_counter()
            for w in p.work if isinstance(p.work, list) else [p.work]:
                w.wait()
            if cuda:
                after.record()
                p.stats._events.append((before, after))
                if len(p.stats._events) > 1024:  # bound the events kept between reads
                    p.stats.resolve()
            else:
                p.stats.exposed_comm_s += time.perf_counter() - t0
    if p.finish is not None:
        p.finish()
    return p.output


def _labelled(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return run

    return wrap


# The single-tensor collectives under their current names, or their older ones on a torch before them.
# Looked up at each call, so a wrapper installed on `torch.distributed` (bench/simulate.py's
# recorder, a profiler) sees them.
def _all_gather_single(*args, **kwargs):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def _gloo(group: ProcessGroup) -> bool:
    return dist.get_backend(group) == "gloo"


HOST_TRANSPORTS = ("shm", "gloo")
_host_transport = ["shm"]
# id(group) -> (a weak reference to the group, its channel or None); a channel closes with its group
_channels: Dict[int, Tuple[weakref.ref, Optional[shm.SharedMemoryChannel]]] = {}


def set_host_transport(name: str) -> None:
    """How gloo groups of ranks on one host move all-gathers and reduce-scatters: "shm" (shared
    memory, the default) or "gloo". It applies from the next collective on: set it the same on
    every rank, between steps."""
    if name not in HOST_TRANSPORTS:
        raise ValueError(f"host transport {name!r}: use one of {', '.join(HOST_TRANSPORTS)}")
    _host_transport[0] = name


def _host_key() -> int:
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


def _open_channel(group: ProcessGroup) -> Optional[shm.SharedMemoryChannel]:
    """Collective over `group`: its shared-memory channel, or None where it stays on gloo."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    able = shm.supported()
    token = int.from_bytes(os.urandom(7), "little")
    mine = torch.tensor([_host_key(), int(able), token], dtype=torch.int64)
    seen = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(seen, mine, group=group)
    if not all(int(t[1]) for t in seen) or len({int(t[0]) for t in seen}) != 1:
        return None
    path = os.path.join(shm.SHM_DIR, f"fsdp-collectives-{int(seen[0][2]):014x}")  # rank 0's token
    channel, ok = None, torch.ones(1, dtype=torch.int64)
    try:
        if r == 0:
            try:
                channel = shm.SharedMemoryChannel.create(path, r, n)
            except OSError:
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # rank 0 has made it: the others map it
        if r != 0 and int(ok):
            try:
                channel = shm.SharedMemoryChannel.attach(path, r, n)
            except OSError:
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has it mapped, or none uses it
    finally:
        if r == 0 and channel is not None:
            channel.unlink()  # nothing stays in /dev/shm, however the processes end
    if not int(ok) and channel is not None:
        channel.close()
    return channel if int(ok) else None


def _channel(group: ProcessGroup, device: torch.device) -> Optional[shm.SharedMemoryChannel]:
    """The shared-memory channel of a gloo `group` for tensors on `device`, opened on first use."""
    if device.type != "cpu" or _host_transport[0] != "shm" or not _gloo(group):
        return None
    entry = _channels.get(id(group))
    if entry is None or entry[0]() is not group:
        channel = _open_channel(group)
        if channel is not None:
            weakref.finalize(group, channel.close)
        entry = _channels[id(group)] = (weakref.ref(group), channel)
    return entry[1]


def reduce_scatter_scratch_numel(group: ProcessGroup, shard_numel: int) -> int:
    """Elements of receive scratch `reduce_scatter` needs on this backend and rank (0 = none)."""
    n = dist.get_world_size(group)
    if n <= 2 or not _gloo(group) or _channel(group, torch.device("cpu")) is not None:
        return 0  # two ranks, and shared memory, receive straight into the output
    r = dist.get_rank(group)
    return (n - 1) * shard_numel if r in (0, n - 1) else n * shard_numel


@_labelled("fsdp::all_gather")
def all_gather(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, stats: CommStats) -> Pending:
    """Async all-gather of equal `shard`s into `output` (rank-major, N x shard)."""
    n = dist.get_world_size(group)
    if n == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Pending(None, output, stats)
    stats.allgather_bytes += (n - 1) * shard.numel() * shard.element_size()
    stats.num_collectives += 1
    if not _gloo(group):
        return Pending(_all_gather_single(output, shard, group=group, async_op=True), output, stats)
    channel = _channel(group, output.device)
    if channel is not None:
        return Pending(channel.all_gather(output, shard), output, stats)
    S, r = shard.numel(), dist.get_rank(group)
    own = output[r * S : (r + 1) * S]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    works = [dist.broadcast(output[j * S : (j + 1) * S], group=group, group_src=j, async_op=True) for j in range(n)]
    return Pending(works, output, stats)


@_labelled("fsdp::reduce_scatter")
def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    stats: CommStats,
    scratch: Optional[torch.Tensor] = None,
) -> Pending:
    """Async sum-reduce-scatter of `full` (N x shard, rank-major) into `output` (one shard).

    On gloo `scratch` must hold `reduce_scatter_scratch_numel` elements; it and `full` must stay
    untouched until `wait` returns.
    """
    n = dist.get_world_size(group)
    if n == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full)
        return Pending(None, output, stats)
    stats.reduce_scatter_bytes += (n - 1) * output.numel() * full.element_size()
    stats.num_collectives += 1
    if not _gloo(group):
        work = _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return Pending(work, output, stats)
    channel = _channel(group, output.device)
    if channel is not None:
        return Pending(channel.reduce_scatter(output, full), output, stats)
    S, r = output.numel(), dist.get_rank(group)
    own = full[r * S : (r + 1) * S]
    if r in (0, n - 1):  # own chunk at one end: exchange only the other chunks
        send = full[S:] if r == 0 else full[: (n - 1) * S]
        splits = [0 if j == r else S for j in range(n)]
        recv = output if n == 2 else scratch[: (n - 1) * S]
        work = dist.all_to_all_single(recv, send, splits, splits, group=group, async_op=True)

        def finish() -> None:
            if n == 2:
                output.add_(own)
                return
            parts = recv.view(n - 1, S)
            torch.add(own, parts[0], out=output)
            for k in range(1, n - 1):
                output.add_(parts[k])
    else:
        recv = scratch[: n * S]
        work = dist.all_to_all_single(recv, full, group=group, async_op=True)

        def finish() -> None:
            torch.sum(recv.view(n, S), dim=0, out=output)

    return Pending(work, output, stats, finish)


@_labelled("fsdp::all_reduce")
def all_reduce(tensor: torch.Tensor, group: ProcessGroup, stats: CommStats) -> Pending:
    """Async in-place sum all-reduce (the replicate dimension of hybrid sharding, NO_SHARD)."""
    n = dist.get_world_size(group)
    if n == 1:
        return Pending(None, tensor, stats)
    stats.allreduce_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
    stats.num_collectives += 1
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return Pending(work, tensor, stats)


@_labelled("fsdp::all_to_all")
def all_to_all(output: torch.Tensor, chunks: torch.Tensor, group: ProcessGroup, stats: CommStats) -> Pending:
    """Async all-to-all of N equal rank-major chunks (quantized gradient reduction)."""
    n = dist.get_world_size(group)
    if n == 1:
        output.copy_(chunks)
        return Pending(None, output, stats)
    stats.alltoall_bytes += (n - 1) * chunks.numel() // n * chunks.element_size()
    stats.num_collectives += 1
    work = dist.all_to_all_single(output, chunks, group=group, async_op=True)
    return Pending(work, output, stats)


def all_reduce_sum_(tensor: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Blocking global sum, for small scalars (grad-norm); not counted in the step's stats."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_object_free(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Blocking all-gather used by state-dict redistribution (outside the step; not counted)."""
    if dist.get_world_size(group) == 1:
        output.copy_(shard)
    else:
        _all_gather_single(output, shard, group=group)
    return output
