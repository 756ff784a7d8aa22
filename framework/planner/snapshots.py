"""Host memory for in-memory snapshots (checkpoint.memory_interval), counted from the planner's
estimate as framework/checkpoint/memory.py and its snapshot_*.py parts allocate it. One rank's
snapshot is its parameter shards and optimizer state (what the planner counts as `params` and
`optimizer` per rank) and the model's buffers (whole on every rank: the family's `buffer_bytes`).
Per rank, the host holds:
- in checkpoint.memory_dir, its own snapshot in up to two generations (the newest committed and the
  one being written: [Note: a snapshot counts once committed]), and with more than one node as
  many copies held for the rank of the same local rank on the node before ([Note: the peer copy]);
- in the rank's process, the host buffers every snapshot is first copied into (one generation,
  kept from snapshot to snapshot), and with more than one node the exchange's two buffers while the
  writer thread sends its committed snapshot and receives the peer's (one generation each).
Checked equal to what the snapshot code allocates on two ranks by
tests/planner/test_snapshot_memory.py (`test_the_planned_snapshot_memory_is_what_the_ranks_allocate`)."""

from __future__ import annotations

from dataclasses import dataclass

GENERATIONS = 2


EXCHANGE_BUFFERS = 2  # the writer thread's send and receive buffers (one generation each)


@dataclass(frozen=True)
class SnapshotMemory:
    per_rank: int  # bytes of one rank's snapshot (one generation)
    own: int  # bytes per node in memory_dir: its ranks' snapshots, all generations
    peers: int  # bytes per node in memory_dir: the copies held for another node's ranks, all generations
    copies: int  # bytes per node in the ranks' processes: the host buffers a snapshot is copied into
    exchange: int  # bytes per node in the ranks' processes: the exchange's send and receive buffers

    @property
    def in_memory_dir(self) -> int:
        return self.own + self.peers

    @property
    def per_node(self) -> int:
        return self.own + self.peers + self.copies + self.exchange


def snapshot_memory(est) -> SnapshotMemory:
    """Per node, for the job of a planner Estimate."""
    job = est.job
    per_rank = est.memory.params + est.memory.optimizer + job.model.buffer_bytes
    ranks = min(job.nproc_per_node, job.world)
    own = GENERATIONS * per_rank * ranks
    several = job.nodes > 1
    return SnapshotMemory(
        per_rank,
        own,
        own if several else 0,
        per_rank * ranks,
        EXCHANGE_BUFFERS * per_rank * ranks if several else 0,
    )


def _parts(snap: SnapshotMemory, digits: int) -> str:
    gib = 1 << 30
    parts = [f"own {snap.own / gib:.{digits}f}", f"peer copies {snap.peers / gib:.{digits}f}"]
    parts.append(f"host buffers {snap.copies / gib:.{digits}f}")
    if snap.exchange:
        parts.append(f"exchange {snap.exchange / gib:.{digits}f}")
    return " + ".join(parts)


def snapshot_problem(interval: int, est) -> str | None:
    """One line when snapshots every `interval` steps (0: off) do not fit the node's host memory
    beside what the job already keeps there (offloaded state); None when they fit."""
    if not interval:
        return None
    from framework.planner.estimate import GIB

    job, snap = est.job, snapshot_memory(est)
    offloaded = est.memory.host * min(job.nproc_per_node, job.world)
    limit = job.device.host_memory_gib * GIB
    if snap.per_node + offloaded <= limit:
        return None
    beside = f" beside {offloaded / GIB:.1f} GiB of offloaded state" if offloaded else ""
    return (
        f"checkpoint.memory_interval={interval}: in-memory snapshots need {snap.per_node / GIB:.1f} GiB of host "
        f"memory per node ({_parts(snap, 1)}; {GENERATIONS} generations in memory_dir){beside}, more than "
        f"the node's {job.device.host_memory_gib:.0f} GiB; set checkpoint.memory_interval=0, or shard over more nodes"
    )


def snapshot_note(interval: int, est) -> str | None:
    """The plan's line about snapshots (None when they are off)."""
    if not interval:
        return None
    from framework.planner.estimate import GIB

    snap = snapshot_memory(est)
    return (
        f"in-memory snapshots every {interval} steps: {snap.per_node / GIB:.2f} GiB of host memory per node "
        f"({_parts(snap, 2)}; {GENERATIONS} generations in memory_dir of {snap.per_rank / GIB:.3f} GiB per rank)"
    )
