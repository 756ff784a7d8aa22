"""One rank's host buffers for its in-memory snapshots and the thread that writes them beside
training ([Note: a snapshot counts once committed] in snapshot_files.py; [Note: the peer copy] in
snapshot_peers.py for what the thread sends to the next node)."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from framework.checkpoint.snapshot_files import Segments
from framework.checkpoint.snapshot_format import local_part, own_tensors
from framework.checkpoint.snapshot_peers import PeerRing


class SnapshotWriter:
    """`copy(state)` on the training thread, `start(...)` the write in a thread of its own, `wait()`
    for it. The thread's only results: `error` (a write that failed: said at the next snapshot)
    and `last_write_s`."""

    def __init__(self, segments: Segments, rank: int, ring: Optional[PeerRing]) -> None:
        self.segments, self.rank, self.ring = segments, rank, ring
        self._buffers: Dict[str, torch.Tensor] = {}  # host copies, reused snapshot after snapshot
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[str] = None
        self.last_write_s = 0.0  # the thread's time for the last snapshot (beside training)

    def copy(self, state) -> Tuple[List[Tuple[list, torch.Tensor]], list]:
        """([(path, host buffer)], the optimizer's plain values): this rank's tensors
        (snapshot_format.own_tensors) copied to its host buffers, which a new shape or dtype
        replaces; returns once the copies are done."""
        tensors, leaves = own_tensors(state.model, state.optimizer)
        items = []
        for path, t in tensors:
            local = local_part(t).detach()
            key = "/".join(path)
            buf = self._buffers.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = self._buffers[key] = torch.empty(
                    local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda"
                )
            buf.copy_(local, non_blocking=True)
            items.append((path, buf))
        if any(t.device.type == "cuda" for _, t in tensors):
            torch.cuda.synchronize()
        return items, leaves

    def start(self, step: int, items, head: dict) -> None:
        """Write `items` with the manifest `head` as this rank's segment of `step`, in a thread."""
        self._thread = threading.Thread(target=self._write, args=(step, items, head), name="memory-snapshot")
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, items, head: dict) -> None:
        tic = time.perf_counter()
        mine = None
        try:
            # every rank committed the newest: see [Note: a snapshot counts once committed]
            self.segments.prune(self.rank, keep=1)
            mine = self.segments.write_own(self.rank, step, items, head)
        except OSError as exc:
            self.error = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        if self.ring is not None and self.ring.group is not None:
            problem = self.ring.exchange(self.segments, step, mine)
            if problem:
                self.error = problem
        self.last_write_s = time.perf_counter() - tic
