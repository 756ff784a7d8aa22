"""In-memory snapshots (checkpoint.memory_interval): what a resume needs, kept in host memory that
outlives the rank process, and the restore a restarted job takes from them before any disk.

Every `memory_interval` steps each rank copies its model and optimizer shards (as the engine holds
them: [Note: a snapshot is the engine's own shards] in snapshot_format.py), the data position,
the RNG and the LR schedule into host buffers, and a thread (snapshot_writer.py) writes them to
one segment in checkpoint.memory_dir (/dev/shm by default) while training goes on; with more
than one node it also sends them to the next node (snapshot_peers.py). See [Note: snapshot
segments outlive the rank, not the job] in shm_names.py for names, ownership and sweeping, [Note: a
snapshot counts once committed] in snapshot_files.py for the files, and snapshot_restore.py for
where a restarted job continues from. This module puts them together for the trainer.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from framework.checkpoint import shm_names
from framework.checkpoint.snapshot_files import Segments, fit_problem
from framework.checkpoint.snapshot_format import manifest_head
from framework.checkpoint.snapshot_peers import PeerRing, nodes_of
from framework.checkpoint.snapshot_restore import RestorePolicy
from framework.checkpoint.snapshot_writer import SnapshotWriter
from framework.errors import UserInputError

DEFAULT_DIR = shm_names.DEFAULT_DIR


def _job_of(run_dir: str) -> str:
    return hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:12]


def _creator_pid() -> int:
    """The process that outlives this rank: the torchrun agent or `main.py` that started the ranks
    (both set TORCHELASTIC_USE_AGENT_STORE), or this process when it runs alone."""
    return os.getppid() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else os.getpid()


class MemorySnapshots:
    """One rank's snapshots: `snapshot(state)` after each step, `restore(state, ckpt)` at the start,
    `close(finished)` at the end. Every rank calls each (they hold collectives)."""

    def __init__(self, cfg, rt, engine, planned: Tuple[Optional[str], Optional[int]] = (None, None)):
        """`planned`: the planner's refusal line (None: fits) and one rank's snapshot bytes, every
        generation (None: not planned), from framework/planner/snapshots.py's `planned_snapshots`."""
        c = cfg.checkpoint
        self.rt, self.interval = rt, c.memory_interval
        directory = os.path.abspath(c.memory_dir or DEFAULT_DIR)
        self.nodes, self._local = nodes_of(rt.world_size)  # [Note: the peer copy]
        self.uid = os.getuid()
        self.job = _job_of(cfg.run_dir)
        pid = _creator_pid()
        self.creator = f"{pid}.{shm_names.start_time(pid)}"
        self.segments = Segments(directory, shm_names.job_prefix(self.uid, self.job, self.creator))
        problem = None
        if not os.path.isdir(directory):
            problem = (
                f"checkpoint.memory_dir={c.memory_dir or DEFAULT_DIR}: {directory} is not a directory on this node; "
                "give an existing directory in host memory (a tmpfs such as /dev/shm), or set "
                "checkpoint.memory_interval=0"
            )
        elif rt.rank % self._local == 0:  # once per node
            problem = self._fit_problem(planned)
        problems = [None] * rt.world_size
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            raise UserInputError(f"{bad[1]} (rank {bad[0]})" if rt.world_size > 1 else bad[1])
        shm_names.sweep_orphans(directory, self.uid)
        self.segments.start_sweeper(self.job, self.creator)
        self.last_copy_s = 0.0  # the step's share of the last snapshot: the copy to host buffers
        self._ring = PeerRing(rt.rank, rt.world_size)  # its group: a collective, on every rank
        self._writer = SnapshotWriter(self.segments, rt.rank, self._ring)
        self._restore = RestorePolicy(rt, self.job, engine, self.segments, self._ring, c.resume)
        self._restore_logged = False

    @property
    def dir(self) -> str:
        return self.segments.dir

    @property
    def last_write_s(self) -> float:
        """The writer thread's time for the last snapshot (beside training)."""
        return self._writer.last_write_s

    def _fit_problem(self, planned) -> Optional[str]:
        """A line when this node's snapshots would not fit: the planner's host memory per node, or
        the free space of memory_dir (with what this job's segments already hold there)."""
        problem, rank_bytes = planned
        if problem or rank_bytes is None:
            return problem
        need = rank_bytes * self._local * (2 if self.nodes > 1 else 1)  # own, and the copies held
        return fit_problem(self.interval, need, self.segments.dir, self.segments.prefix)

    def metrics(self) -> Dict[str, float]:
        """For the step's record: the last snapshot's cost on the step (its copy to host buffers,
        spread over the interval) and its write beside training; once, the restore's time and
        whether it came from memory (1) or the disk (0)."""
        out = {"snapshot_s_per_step": self.last_copy_s / self.interval, "snapshot_write_s": self.last_write_s}
        source = self._restore.source
        if source and not self._restore_logged:
            out.update(restore_s=self._restore.seconds, restore_from_memory=float(source.startswith("memory")))
            self._restore_logged = True
        return out

    # ---- taking snapshots ----

    def should_snapshot(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def snapshot(self, state) -> None:
        """After step `state.step`: copy what a resume needs to host buffers, then write it in a
        thread. See [Note: a snapshot counts once committed] in snapshot_files.py."""
        if not self.should_snapshot(state.step):
            return
        self._agree_previous_written()
        tic = time.perf_counter()
        items, leaves = self._writer.copy(state)
        head = manifest_head(state, self.job, self.rt.rank, self.rt.world_size, leaves)
        self.last_copy_s = time.perf_counter() - tic
        self._writer.start(state.step, items, head)

    def _agree_previous_written(self) -> None:
        """Wait for this rank's writer; every rank learns whether any rank's last write failed."""
        self.wait()
        errors = [None] * self.rt.world_size
        dist.all_gather_object(errors, self._writer.error)
        bad = next(((r, e) for r, e in enumerate(errors) if e), None)
        if bad:
            raise UserInputError(
                f"checkpoint.memory_dir={self.segments.dir}: rank {bad[0]} could not write its snapshot "
                f"({bad[1]}); free memory there, raise checkpoint.memory_interval, or set "
                "checkpoint.memory_interval=0"
            )

    def wait(self) -> None:
        self._writer.wait()

    # ---- restoring ----

    def restore(self, state, ckpt) -> int:
        """Every rank: the step the job continues from, restored (snapshot_restore.py)."""
        return self._restore.restore(state, ckpt)

    # ---- the end ----

    def close(self, finished: bool) -> None:
        """Let the writer end; a finished job removes its segments, its own and the copies it holds
        for a peer (a failed one leaves them to a restart, and the sweeper removes them once the
        job's creator ends)."""
        self.wait()
        if finished:
            self.segments.prune(self.rt.rank, keep=0)
            if self._ring.group is not None:
                self.segments.prune(self._ring.from_, keep=0, kind="p")
