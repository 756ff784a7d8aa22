"""The copy of every rank's snapshot kept on the next node, and the exchanges over the network that
keep and return it (framework/checkpoint/memory.py takes and restores snapshots with it).

[Note: the peer copy]
With more than one node, every snapshot is also kept on the next node: the rank of the same
local rank there (ring order over nodes) receives it over a gloo group of its own, in the
writer thread, once the owner committed it locally, and keeps it in its own memory_dir as a
`p<owner>` segment (committed as its own are: data, then the manifest renamed). A restore
takes each rank's shard from its local segment when present and whole, else from the copy
its peer holds (sent back over the same group, hash checked by the receiver), else the whole
job falls back to the disk. A rank whose own write failed still sends (an empty copy), so
the ring never waits on it; the failure is then said at the next snapshot. Nodes are blocks of
LOCAL_WORLD_SIZE consecutive ranks (torchrun's order).
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from framework.checkpoint.snapshot_files import Segments, read_pair, read_segment
from framework.checkpoint.snapshot_format import SnapshotRefused


def nodes_of(world: int) -> Tuple[int, int]:
    """(nodes, ranks per node) of this job: [Note: the peer copy]."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = world // local if local and world % local == 0 else 1
    return nodes, world // nodes


class PeerRing:
    """This rank's place in the ring over nodes: the rank that holds its copy (`to`), the rank whose
    copy it holds (`from_`), and the gloo group they talk over (made here, on every rank: a
    collective; None on one node)."""

    def __init__(self, rank: int, world: int) -> None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.nodes, self.local = nodes_of(world)
        self.rank = rank
        self.to = (rank + local) % world  # holds this rank's copy
        self.from_ = (rank - local) % world  # whose copy this rank holds
        from framework.distributed.groups import new_group  # made with the job's timeout

        self.group = new_group(backend="gloo") if self.nodes > 1 else None

    def node(self, rank: int) -> int:
        return rank // self.local

    def exchange(self, segments: Segments, step: int, mine: Optional[str]) -> Optional[str]:
        """Send this rank's committed segment `mine` (None: its write failed) to its peer, keep the
        one of the rank before; the problem writing that copy, or None. Its two buffers (the
        segment read back to send, the peer's received) are one generation each, freed before the
        next snapshot: counted by framework/planner/snapshots.py."""
        try:
            payload = read_segment(mine + ".json") if mine else (b"", None)
        except (OSError, SnapshotRefused):
            payload = (b"", None)
        manifest, data = _swap(payload, self.to, self.from_, self.group)
        payload = None  # the send buffer goes before the received one is written
        if not manifest:
            return None
        try:
            segments.prune(self.from_, keep=1, kind="p")
            segments.write_copy(self.from_, step, manifest, data)
        except OSError as exc:
            return f"the peer copy of rank {self.from_}: {exc.strerror or exc}"
        return None

    def fetch(self, sources: Dict[int, Optional[int]], held, step: int) -> Tuple[bytes, bytearray]:
        """Every rank: send the copies this rank was chosen for (`sources`: rank -> the rank that
        sends it its copy), receive this rank's own if it needs one (over the peer group, sizes
        first); (manifest, data) received, or empty."""
        me, group = self.rank, self.group or dist.group.WORLD
        outgoing = [r for r, s in sorted(sources.items()) if s == me]
        payloads = {}
        for r in outgoing:
            try:
                payloads[r] = read_pair(held[r][step])[:2]
            except (OSError, SnapshotRefused, KeyError):
                payloads[r] = (b"", b"")
        ops, sizes = [], torch.zeros(2, dtype=torch.int64)
        for r in outgoing:
            ops.append(dist.isend(torch.tensor([len(payloads[r][0]), len(payloads[r][1])]), r, group=group))
        if sources.get(me) is not None:
            ops.append(dist.irecv(sizes, sources[me], group=group))
        for op in ops:
            op.wait()
        ops, buf = [], None
        for r in outgoing:
            if payloads[r][0]:
                whole = torch.frombuffer(bytearray(payloads[r][0]) + payloads[r][1], dtype=torch.uint8)
                ops.append(dist.isend(whole, r, group=group))
        if sources.get(me) is not None and int(sizes[0]):
            buf = torch.empty(int(sizes[0] + sizes[1]), dtype=torch.uint8)
            ops.append(dist.irecv(buf, sources[me], group=group))
        for op in ops:
            op.wait()
        if buf is None:
            return b"", bytearray()
        raw = buf.numpy().tobytes()
        return raw[: int(sizes[0])], bytearray(raw[int(sizes[0]) :])


def _swap(payload: Tuple[bytes, Optional[torch.Tensor]], to: int, source: int, group):
    """Send `payload` (manifest bytes, data tensor) to rank `to` and receive one from `source` over
    `group` (sizes first, then the manifest and the data, each as it is: no joined copy); (manifest
    bytes, data tensor) received, (b"", None) when nothing came."""
    manifest, data = payload
    nbytes = data.numel() if data is not None else 0
    sizes = torch.zeros(2, dtype=torch.int64)
    ops = [dist.isend(torch.tensor([len(manifest), nbytes], dtype=torch.int64), to, group=group)]
    ops.append(dist.irecv(sizes, source, group=group))
    for op in ops:
        op.wait()
    ops, got_manifest, got = [], None, None
    if manifest:
        ops.append(dist.isend(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), to, group=group))
        if nbytes:
            ops.append(dist.isend(data, to, group=group))
    if int(sizes[0]):
        got_manifest = torch.frombuffer(bytearray(int(sizes[0])), dtype=torch.uint8)
        ops.append(dist.irecv(got_manifest, source, group=group))
        got = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if int(sizes[1]):
            ops.append(dist.irecv(got, source, group=group))
    for op in ops:
        op.wait()
    if got_manifest is None:
        return b"", None
    return got_manifest.numpy().tobytes(), got
