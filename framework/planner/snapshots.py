"""Host memory for in-memory snapshots (checkpoint.memory_interval), counted from the planner's
estimate: a snapshot holds a rank's parameter shards and optimizer state (what the planner counts
as `params` and `optimizer` per rank), each node keeps its ranks' own snapshots and, with more
than one node, the copies it holds for the ranks of the node before it ([Note: the peer copy] in
framework/checkpoint/memory.py), and each of those in up to two generations (the newest committed
and the one being written: [Note: a snapshot counts once committed])."""

from __future__ import annotations

from dataclasses import dataclass

GENERATIONS = 2


@dataclass(frozen=True)
class SnapshotMemory:
    per_rank: int  # bytes of one rank's snapshot (one generation)
    own: int  # bytes per node: its ranks' snapshots, all generations
    peers: int  # bytes per node: the copies held for another node's ranks, all generations

    @property
    def per_node(self) -> int:
        return self.own + self.peers


def snapshot_memory(est) -> SnapshotMemory:
    """Per node, for the job of a planner Estimate."""
    job = est.job
    per_rank = est.memory.params + est.memory.optimizer
    ranks = min(job.nproc_per_node, job.world)
    own = GENERATIONS * per_rank * ranks
    return SnapshotMemory(per_rank, own, own if job.nodes > 1 else 0)


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
    return (
        f"checkpoint.memory_interval={interval}: in-memory snapshots need {snap.per_node / GIB:.1f} GiB of host "
        f"memory per node (own {snap.own / GIB:.1f} + peer copies {snap.peers / GIB:.1f}, {GENERATIONS} "
        f"generations){f' beside {offloaded / GIB:.1f} GiB of offloaded state' if offloaded else ''}, more than "
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
        f"(own {snap.own / GIB:.2f} + peer copies {snap.peers / GIB:.2f}, {GENERATIONS} generations of "
        f"{snap.per_rank / GIB:.3f} GiB per rank)"
    )
