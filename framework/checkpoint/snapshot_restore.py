"""Where a restarted job continues from: the newest in-memory snapshot every rank has whole (its
own node's, or the copy another node holds: [Note: the peer copy] in snapshot_peers.py), else the
disk checkpoint, else the start. Every rank runs it (it holds collectives)."""

from __future__ import annotations

import sys
import time
from typing import Dict, Optional

import torch.distributed as dist

from framework.checkpoint import snapshot_format
from framework.checkpoint.snapshot_files import Segments, read_pair
from framework.checkpoint.snapshot_format import SnapshotRefused, own_tensors
from framework.checkpoint.snapshot_peers import PeerRing


class RestorePolicy:
    """`restore(state, ckpt)` once, at the start; then `source` ("memory", "memory (peer)", "disk",
    or None where there was no snapshot to weigh) and `seconds` say how it went."""

    def __init__(self, rt, job: str, engine, segments: Segments, ring: PeerRing, resume: str) -> None:
        self.rt, self.job, self.engine, self.segments, self.ring = rt, job, engine, segments, ring
        self.resume = resume  # checkpoint.resume: only "auto" weighs the disk's latest step
        self.source: Optional[str] = None
        self.seconds = 0.0

    def restore(self, state, ckpt) -> int:
        """Every rank: continue from the newest snapshot every rank has whole (in its own node's
        memory, or a copy on another node's), or else from the disk checkpoint as `ckpt.resume`
        would (0 without one). Rank 0 says which step and from where."""
        world, me = self.rt.world_size, self.rt.rank
        held = self.segments.held()
        missing = any(not state.optimizer.state.get(p) for p in state.model.parameters() if p.requires_grad)
        shares = [None] * world
        dist.all_gather_object(shares, ({owner: sorted(steps) for owner, steps in held.items()}, missing))
        missing = any(m for _, m in shares)
        shares = [h for h, _ in shares]
        common = None
        for r in range(world):
            steps = {step for share in shares for step in share.get(r, ())}
            common = steps if common is None else common & steps
        newest = max(common) if common else None
        disk = self._disk_step(ckpt)
        if newest is None or (disk is not None and disk > newest):
            if any(shares):
                why = "no step every rank has" if newest is None else f"the disk's step {disk} is newer"
                return self._from_disk(state, ckpt, f"memory snapshots: {why}")
            return ckpt.resume(state) if ckpt is not None else 0
        tic = time.perf_counter()
        # a restarted process has no optimizer state: the engine makes it, on every rank (its state
        # dicts are collective), before the snapshot's bytes go over it
        if missing:
            self.engine.get_state_dicts(state.model, state.optimizer)
        targets = own_tensors(state.model, state.optimizer)[0]
        problem, loaded = None, None
        try:
            if newest not in held.get(me, {}):
                raise SnapshotRefused(f"no snapshot of step {newest} on this rank's node")
            raw, data, path = read_pair(held[me][newest])
            loaded = self._parse(raw, data, path, targets)
        except SnapshotRefused as exc:
            problem = str(exc)
        local_problems = [None] * world
        dist.all_gather_object(local_problems, problem)
        sources: Dict[int, Optional[int]] = {}  # rank whose own is missing or torn -> the rank sending its copy
        for r, p in enumerate(local_problems):
            if p:
                sources[r] = next(
                    (
                        s
                        for s in range(world)
                        if self.ring.node(s) != self.ring.node(r) and newest in shares[s].get(r, ())
                    ),
                    None,
                )
        if any(s is not None for s in sources.values()):
            got = self.ring.fetch(sources, held, newest)
            if problem and sources[me] is not None:
                try:
                    loaded, problem = self._parse(*got, f"the copy rank {sources[me]} holds", targets), None
                except SnapshotRefused as exc:
                    problem = f"{problem}; its copy on rank {sources[me]}: {exc}"
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            why = f"the memory snapshot of step {newest} on rank {bad[0]} is refused: {bad[1]}"
            return self._from_disk(state, ckpt, why)
        snapshot_format.apply(state, *loaded)
        self.source = "memory (peer)" if sources else "memory"
        self.seconds = time.perf_counter() - tic
        if self.rt.is_main:
            where = f"local, {self.segments.dir}"
            if sources:
                where += "; for rank(s) " + ", ".join(f"{r} the copy on rank {s}" for r, s in sorted(sources.items()))
            print(f"restored step {newest} from memory ({where}) in {self.seconds:.3f} s", file=sys.stderr, flush=True)
        return newest

    def _parse(self, raw: bytes, data: bytearray, where: str, targets: list):
        return snapshot_format.parse(raw, data, where, targets, self.job, self.rt.rank, self.rt.world_size)

    def _disk_step(self, ckpt) -> Optional[int]:
        if ckpt is None or self.resume != "auto":
            return None
        from framework.checkpoint import layout

        try:
            path = layout.latest_checkpoint(ckpt.root)
        except layout.CheckpointError:
            return None
        return layout.step_of(path) if path else None

    def _from_disk(self, state, ckpt, why: str) -> int:
        tic = time.perf_counter()
        step = ckpt.resume(state) if ckpt is not None else 0
        self.source, self.seconds = "disk", time.perf_counter() - tic
        if self.rt.is_main:
            where = "disk" if step else "the start (no disk checkpoint)"
            print(f"restored step {step} from {where}: {why}", file=sys.stderr, flush=True)
        return step
