"""The shared state of one sharded model: its units, the step's phase, the recorded order.

Created lazily by the first forward of the outermost sharded module (the root). Holds the
gradient-buffer pool and the reductions in flight, which the root's final backward callback
drains before `optimizer.step()` may run.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from .api import TrainingPhase
from .unit import ShardUnit

# [Note: the gradient buffer pool]
# A unit's reduce-scatter input (its full gradients, flat) is needed only from the unit's last
# gradient until its reduce-scatter completes. Usually it is the unit's own gathered storage
# (see [Note: gradients reuse the gathered storage] in unit.py) and no pool buffer is used; the
# pool serves units with frozen parameters, a reduce dtype different from the param dtype, or
# int8 reduction outputs. The pool hands out buffers by (dtype, device, size)
# and gets them back in `finish_reduce`; when none is free and two reductions are in flight it
# first finishes the oldest, so at most ~3 buffers exist and, because every step asks for the same
# sizes in the same order, nothing is allocated after step 1.
MAX_IN_FLIGHT = 2


class ShardContext:
    def __init__(self, root: ShardUnit, units: List[ShardUnit]) -> None:
        self.root = root
        self.units = units  # module order (deterministic on all ranks)
        self.order: List[ShardUnit] = []  # forward order, recorded on the first step
        self.order_frozen = False
        self.phase = TrainingPhase.IDLE
        self.pending_units: List[ShardUnit] = []
        self.callback_queued = False
        self._pool: Dict[Tuple, List[torch.Tensor]] = {}
        self.rank = dist.get_rank()
        for u in units:
            u.ctx = self

    def set_phase(self, new: TrainingPhase) -> None:
        legal = {
            TrainingPhase.IDLE: (TrainingPhase.FORWARD, TrainingPhase.PRE_BACKWARD),  # a non-root's own forward
            TrainingPhase.FORWARD: (TrainingPhase.PRE_BACKWARD, TrainingPhase.IDLE, TrainingPhase.FORWARD),
            TrainingPhase.PRE_BACKWARD: (TrainingPhase.POST_BACKWARD,),
            TrainingPhase.POST_BACKWARD: (TrainingPhase.IDLE,),
        }
        assert new in legal[self.phase], (
            f"[rank {self.rank}] root {self.root.name}: illegal phase transition {self.phase.value} -> {new.value}"
        )
        self.phase = new

    # ------------------------------------------------------------ buffer pool
    def acquire_grad_buffer(self, numel: int, dtype: torch.dtype, device: torch.device, tag: str = "in") -> torch.Tensor:
        key = (tag, dtype, device.type, device.index)
        while True:
            free = self._pool.setdefault(key, [])
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                del free[next(i for i, b in enumerate(free) if b is buf)]
                return buf[:numel] if buf.numel() != numel else buf
            if len(self.pending_units) >= MAX_IN_FLIGHT:
                self.pending_units.pop(0).finish_reduce()
                continue
            buf = torch.empty(numel, dtype=dtype, device=device)
            buf._pool_key = key
            return buf

    def add_pending(self, unit: ShardUnit) -> None:
        """Track an issued reduction; finish the oldest ones so at most MAX_IN_FLIGHT hold memory."""
        self.pending_units.append(unit)
        while len(self.pending_units) > MAX_IN_FLIGHT:
            self.pending_units.pop(0).finish_reduce()

    def release_grad_buffer(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        self._pool.setdefault(base._pool_key, []).append(base)

    def pool_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for bufs in self._pool.values() for b in bufs)

    # ------------------------------------------------------------ end of backward
    def finish_backward(self) -> None:
        """Final callback of the root: drain reductions, reshard everything, go idle."""
        self.set_phase(TrainingPhase.POST_BACKWARD)
        # Units whose last gradient never arrived (unused or partly-used params) reduce now, in a
        # fixed order so all ranks issue the same collectives.
        for u in reversed(self.order or self.units):
            if u._grads_seen > 0 and not u._reduce_issued:
                u.reduce_grads()
        while self.pending_units:
            self.pending_units.pop(0).finish_reduce()
        for dev in {u.compute_device for u in self.units if u.offload and u.compute_device.type == "cuda"}:
            torch.cuda.current_stream(dev).synchronize()  # offloaded grad shards were copied non-blocking
        for u in self.units:
            u.reshard()
            u.reset_backward()
        self.callback_queued = False
        self.set_phase(TrainingPhase.IDLE)

    def reshard_all(self) -> None:
        for u in self.units:
            u.reshard()
