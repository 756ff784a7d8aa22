"""Every collective of the engine, as free functions over an explicit transport or process group.

Each issuing function returns a small NamedTuple holding the work handle and the buffers it
writes; `wait()` on it is the only place the engine blocks on communication, and it adds the time
spent blocked to `CommStats.exposed_comm_s` (the exposed-communication counter). Byte counters
count what a collective moves, whichever transport moves it: an all-gather the bytes this rank
*receives* ((N-1) x shard bytes), a reduce-scatter or all-to-all the bytes it *sends* ((N-1) x
shard bytes), an all-reduce the ring volume 2 (N-1)/N x tensor bytes. Every issue runs under a
profiler label naming the unit (`fsdp::all_gather(layers.3)`), so a trace says which unit waits.

The bulk all-gathers and reduce-scatters go through the group's `Transport` ([Note: one
transport per group] in transport.py), chosen once per group by `transport_for`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from .host import host_transport
from .mesh import engine_groups
from .transport import Transport, _all_gather_single


@dataclass
class CommStats:
    """Counters of one unit; `comm_stats()` on a module sums them over its units."""

    allgather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    allreduce_bytes: int = 0
    alltoall_bytes: int = 0
    num_collectives: int = 0
    exposed_comm_s: float = 0.0
    # whole-matrix transforms ([Note: whole matrices from pieces] in whole.py): the FLOPs this rank
    # ran, and the busiest rank's planned work over the mean (the calls' largest)
    whole_matrix_flops: int = 0
    whole_matrix_max_over_ideal: float = 0.0
    # CUDA: (before, after) events around each wait on the compute stream, read by resolve()
    _events: List[Tuple[Any, Any]] = field(default_factory=list, repr=False)

    def reset(self) -> None:
        """Zero the counters. Never waits: the timed waits not read yet are dropped unread (the
        trainer resets every step and reads on log steps only; [Note: the host reads the device
        on log steps only] in framework/metrics.py)."""
        self._events.clear()
        self.allgather_bytes = self.reduce_scatter_bytes = self.allreduce_bytes = 0
        self.alltoall_bytes = self.num_collectives = self.whole_matrix_flops = 0
        self.exposed_comm_s = self.whole_matrix_max_over_ideal = 0.0

    def resolve(self, wait: bool = True) -> None:
        """Add the timed CUDA waits to exposed_comm_s: all of them, synchronizing on the last, or
        (`wait=False`) those the device has already passed, without waiting."""
        kept = []
        for before, after in self._events:
            if wait:
                after.synchronize()
            elif not after.query():
                kept.append((before, after))
                continue
            self.exposed_comm_s += before.elapsed_time(after) / 1000.0
        self._events[:] = kept


class Pending(NamedTuple):
    """An issued collective: wait on `work`, then read `output`."""

    work: Any  # dist.Work, a list of them, or None when there is nothing to wait for
    output: torch.Tensor
    stats: CommStats
    finish: Optional[Callable[[], None]] = None  # local work after the wait (e.g. summing chunks)


def wait(p: Optional[Pending]) -> Optional[torch.Tensor]:
    """Block until `p` is done; the blocked time counts as exposed communication.

    On a CPU group the host blocks in `work.wait()`: that time is measured on the host clock. On
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
                if len(p.stats._events) > 1024:  # bound the events kept between reads, not waiting
                    p.stats.resolve(wait=False)
            else:
                p.stats.exposed_comm_s += time.perf_counter() - t0
    if p.finish is not None:
        p.finish()
    return p.output


def transport_for(group: ProcessGroup, device: torch.device) -> Transport:
    """The transport of `group` for tensors on `device`: chosen on first use (a collective over
    the group for a host transport; every rank asks in the same order), then kept by the world's
    `EngineGroups` (mesh.py), which closes it when its world goes; see [Note: one transport per
    group] in transport.py."""
    made = engine_groups().transports
    entry = made.get(id(group))
    if entry is None or entry[0]() is not group:
        entry = made[id(group)] = (weakref.ref(group), {})
    chosen = entry[1].get(device.type)
    if chosen is None:
        single = dist.get_world_size(group) == 1  # nothing to move: the collectives return at once
        chosen = (None if single else host_transport(group, device)) or Transport(group)
        entry[1][device.type] = chosen
    return chosen


def all_gather(
    output: torch.Tensor, shard: torch.Tensor, transport: Transport, stats: CommStats, label: str
) -> Pending:
    """Async all-gather of equal `shard`s into `output` (rank-major, N x shard)."""
    n = transport.world
    if n == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return Pending(None, output, stats)
    stats.allgather_bytes += (n - 1) * shard.numel() * shard.element_size()
    stats.num_collectives += 1
    with record_function(f"fsdp::all_gather({label})"):
        return Pending(transport.all_gather(output, shard), output, stats)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    transport: Transport,
    stats: CommStats,
    label: str,
    scratch: Optional[torch.Tensor] = None,
) -> Pending:
    """Async sum-reduce-scatter of `full` (N x shard, rank-major) into `output` (one shard).

    `scratch` holds `transport.scratch_numel(shard)` elements; it and `full` must stay untouched
    until `wait` returns.
    """
    n = transport.world
    if n == 1:
        if output.data_ptr() != full.data_ptr():
            output.copy_(full)
        return Pending(None, output, stats)
    stats.reduce_scatter_bytes += (n - 1) * output.numel() * full.element_size()
    stats.num_collectives += 1
    with record_function(f"fsdp::reduce_scatter({label})"):
        work, finish = transport.reduce_scatter(output, full, scratch)
    return Pending(work, output, stats, finish)


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, stats: CommStats, label: str, op=dist.ReduceOp.SUM
) -> Pending:
    """Async in-place all-reduce: the sum over the replicate dimension of hybrid sharding and
    NO_SHARD; the max of the float8 gather's per-parameter absmax."""
    n = dist.get_world_size(group)
    if n == 1:
        return Pending(None, tensor, stats)
    stats.allreduce_bytes += 2 * (n - 1) * tensor.numel() * tensor.element_size() // n
    stats.num_collectives += 1
    with record_function(f"fsdp::all_reduce({label})"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, tensor, stats)


def all_to_all(
    output: torch.Tensor, chunks: torch.Tensor, group: ProcessGroup, stats: CommStats, label: str
) -> Pending:
    """Async all-to-all of N equal rank-major chunks (quantized gradient reduction)."""
    n = dist.get_world_size(group)
    if n == 1:
        output.copy_(chunks)
        return Pending(None, output, stats)
    stats.alltoall_bytes += (n - 1) * chunks.numel() // n * chunks.element_size()
    stats.num_collectives += 1
    with record_function(f"fsdp::all_to_all({label})"):
        work = dist.all_to_all_single(output, chunks, group=group, async_op=True)
    return Pending(work, output, stats)


def tree_reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, transport: Transport, stats: CommStats, label: str
) -> Pending:
    """Async reduce-scatter of `full` (N x shard, rank-major) into `output`, the ranks' chunks added
    in the canonical tree's order (`Transport.tree_reduce_scatter`; the deterministic mode). Its
    bytes are an all-to-all's, counted as one ((N-1) chunks sent)."""
    n = transport.world
    if n == 1:
        output.copy_(full)
        return Pending(None, output, stats)
    stats.alltoall_bytes += (n - 1) * output.numel() * full.element_size()
    stats.num_collectives += 1
    with record_function(f"fsdp::tree_reduce_scatter({label})"):
        work, finish = transport.tree_reduce_scatter(output, full)
    return Pending(work, output, stats, finish)


def all_to_all_v(
    output: torch.Tensor,
    sent: torch.Tensor,
    output_splits: List[int],
    sent_splits: List[int],
    group: ProcessGroup,
    stats: CommStats,
    label: str,
) -> Pending:
    """Async all-to-all of uneven, rank-major chunks: `sent_splits[r]` elements of `sent` go to rank
    r, `output_splits[r]` come from it (whole matrices to their owners and back). Counts the bytes
    sent to the other ranks."""
    me = dist.get_rank(group)
    stats.alltoall_bytes += (sum(sent_splits) - sent_splits[me]) * sent.element_size()
    stats.num_collectives += 1
    with record_function(f"fsdp::all_to_all({label})"):
        work = dist.all_to_all_single(output, sent, output_splits, sent_splits, group=group, async_op=True)
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
        _all_gather_single(output, shard, group=group)  # outside the step: the default transport
    return output
