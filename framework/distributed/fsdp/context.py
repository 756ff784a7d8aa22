"""The shared state of one sharded model: its units, the step's phase, the recorded order.

Created lazily by the first forward of the outermost sharded module (the root). Holds the
gradient-buffer pool and the reductions in flight, which the root's final backward callback
drains before `optimizer.step()` may run.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.profiler import record_function

from .api import TrainingPhase
from .unit import ShardUnit

# [Note: the gradient buffer pool]
# A unit's reduce-scatter input (its full gradients, flat) is needed only from the unit's last
# gradient until its reduce-scatter completes. Usually it is the unit's own gathered storage
# (see [Note: gradients reuse the gathered storage] in unit.py) and no pool buffer is used; the
# pool serves units with frozen parameters, a reduce dtype different from the param dtype, or
# int8 reduction outputs, plus short-lived scratch (a transport's reduce-scatter receive scratch, dequantization).
# Every buffer of one (tag, dtype, device) is cut to the largest size any unit of the model asks
# for under that tag, so any free buffer fits any request and the pool never holds two sizes of
# one kind. When none is free and MAX_IN_FLIGHT reductions are in flight it first finishes the
# oldest, so each kind holds at most ~3 buffers of O(largest unit) and, because every step asks
# in the same order, nothing is allocated after step 1. On the host the pool is kept between steps
# (a fresh buffer of that size costs page faults on every step); on an accelerator it is let go at
# the end of backward, since the caching allocator hands the same blocks back next step at no cost,
# and kept it would sit in the optimizer step's and the forward's peak (FSDP2 holds no such pool).
MAX_IN_FLIGHT = 2
POOL_KEPT_BETWEEN_STEPS_ON = frozenset({"cpu"})  # device types whose pool outlives the backward

# [Note: reductions in a fixed order on their own group]
# Every rank must issue the same collectives in the same order on a group. Which of a unit's
# parameters get a gradient can depend on the data (MoE-style experts, a branch taken by some
# rows only), so the moment a unit's last gradient arrives differs between ranks, and a
# reduction issued then could pair with a different collective on another rank (a hang, or
# silently summed wrong buffers). So: (1) reductions are issued strictly in one order that every
# rank knows, the units with trainable parameters in reverse module order (the backward order of
# a sequential model), each as soon as it and all before it are ready; units not run forward
# this step are skipped (all ranks run the same units forward: their gathers must match too);
# (2) the final callback issues whatever is left, in the same order, with zeros for gradients
# this rank never saw; a backward that did not pass through the root's outputs (a chunked loss's
# head called on its own after the root's forward, `model.block(x).backward()`) reduces only the
# units it reached (a hook on their outputs, or a gradient), as FSDP2 reduces only what has
# gradients: the others keep waiting for the backward through the root; (3) reductions run on a
# group of their own (same ranks as the shard group), so their order never interleaves with the
# backward's all-gathers, whose timing is the data's. A unit that waits for an earlier one keeps
# its gradients, which costs memory only when the order differs from the backward's.


class ShardContext:
    def __init__(self, root: ShardUnit, units: List[ShardUnit]) -> None:
        self.root = root
        self.units = units  # module order (deterministic on all ranks)
        self.order: List[ShardUnit] = []  # forward order, recorded on the first step
        self.order_frozen = False
        self.phase = TrainingPhase.IDLE
        self.in_root_forward = False  # between the root's forward pre-hook and post-hook
        self.root_reached = False  # this backward passed through the root's outputs
        self.pending_units: List[ShardUnit] = []
        self.callback_queued = False
        self.in_parts = False  # inside backward_in_parts: the autograd calls queue no final callback
        self.reduce_order: List[ShardUnit] = [u for u in reversed(units) if u.trainable]
        self.next_reduce = 0  # index into reduce_order of the next reduction to issue
        self.step = 0  # forward/backward rounds; a forward after a finished backward starts the next
        self.backward_done = False
        self._pool: Dict[Tuple, List[torch.Tensor]] = {}
        self._owned: Dict[int, Tuple[Tuple, torch.Tensor]] = {}  # id(buffer) -> (key, buffer): all, free or in use
        self._caps: Dict[str, int] = {}
        self.rank = dist.get_rank()
        fqns = {id(m): name for name, m in root.module.named_modules()}
        for u in units:
            u.ctx = self
            # profiler labels and messages name the unit by its path in the model (`layers.3`)
            u.name = fqns.get(id(u.module)) or u.name
        for u in units:  # every rank, in module order: see [Note: one transport per group]
            u.transports()

    def trainable_changed(self) -> None:
        """A unit's trainable parameters changed between steps ([Note: requires_grad is read at
        every step] in unit.py): the reduction order and the pool's buffer sizes follow."""
        self.reduce_order = [u for u in reversed(self.units) if u.trainable]
        self.next_reduce = 0
        self._caps.clear()
        self._pool.clear()
        self._owned.clear()

    def set_phase(self, new: TrainingPhase) -> None:
        legal = {
            # PRE_BACKWARD from IDLE: a non-root's own forward, or a second backward over a
            # retained graph (retain_graph=True)
            TrainingPhase.IDLE: (TrainingPhase.FORWARD, TrainingPhase.PRE_BACKWARD),
            TrainingPhase.FORWARD: (TrainingPhase.PRE_BACKWARD, TrainingPhase.IDLE, TrainingPhase.FORWARD),
            TrainingPhase.PRE_BACKWARD: (TrainingPhase.POST_BACKWARD,),
            TrainingPhase.POST_BACKWARD: (TrainingPhase.IDLE,),
        }
        assert new in legal[self.phase], (
            f"[rank {self.rank}] root {self.root.name}: illegal phase transition {self.phase.value} -> {new.value}"
        )
        self.phase = new

    # ------------------------------------------------------------ step progress
    # [Note: one writer of step progress]
    # The model's progress through a step (the phase, the step count, the forward order while it
    # is recorded, whether the root's forward is running, whether this backward passed through
    # the root, the final callback queued, which units run on their own) is written by this
    # object's methods only; the hooks (hooks.py) call them and read the flags. A unit's gradient
    # progress (its forward uses, the gradients arrived, its reduction issued) is its reduction's
    # (reduce.py's GradReduction), moved on by the hooks' calls and by this object, and the hooks
    # read it through `backward_finished` and `awaiting_backward` here.
    def begin_forward(self, unit: ShardUnit) -> None:
        """A unit's forward pre-hook (not a recomputation). A unit run on its own after the
        root's forward (a chunked loss's head, `model.block(x)`) prefetches nothing, in forward
        or backward: the order recorded around it is not this call's."""
        unit.standalone = unit is not self.root and not self.in_root_forward
        if unit is self.root:
            self.in_root_forward = True

    def record_order(self, unit: ShardUnit) -> None:
        """Record the forward order on the first step under grad mode."""
        if not self.order_frozen and torch.is_grad_enabled():
            self.order.append(unit)

    def end_root_forward(self, grad: bool) -> None:
        self.order_frozen = self.order_frozen or grad
        self.in_root_forward = False

    def backward_reached(self, unit: ShardUnit, member: Optional[nn.Module]) -> None:
        """Backward reached an output of `unit` (of `member`, in a group): note it, enter the
        backward phase and queue the final callback once."""
        unit.reduction.note_reached(member)
        self.root_reached = self.root_reached or unit is self.root
        if self.phase in (TrainingPhase.FORWARD, TrainingPhase.IDLE):  # IDLE: forward ran through a non-root unit only
            self.set_phase(TrainingPhase.PRE_BACKWARD)
        if not self.callback_queued and not self.in_parts:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    # [Note: one backward in several autograd calls]
    # A zero-bubble pipeline schedule computes a microbatch's weight gradients apart from, and
    # after, its input gradients, as one autograd call per group of weights
    # (framework/distributed/pipeline.py, [Note: zero-bubble schedules on our engine]). Those calls
    # together are one backward of the model: its units are gathered first where a forward freed
    # them since (a unit's gradient hooks write into, and assert, its gathered storage), none of
    # the calls queues the final callback (it would reset the backward's progress between them and
    # issue a unit's reduction before all its gradients are in), and the final callback runs once,
    # after the last call, draining the reductions as after any backward.
    @contextlib.contextmanager
    def backward_in_parts(self) -> Iterator[None]:
        assert not self.callback_queued and not self.in_parts, (
            f"[rank {self.rank}] root {self.root.name}: backward_in_parts inside a backward"
        )
        if self.phase in (TrainingPhase.IDLE, TrainingPhase.FORWARD):
            self.set_phase(TrainingPhase.PRE_BACKWARD)
        units = [u for u in self.units if u.trainable and u.unshard_in_backward]
        with torch.no_grad():
            for u in units:  # issue every gather, then wait: they overlap one another
                u.unshard()
            for u in units:
                u.wait_unshard()
        self.in_parts = True
        try:
            yield
        finally:
            self.in_parts = False
        self.finish_backward()

    def backward_finished(self, unit: ShardUnit) -> bool:
        """The unit's backward is over (every gradient in, or its reduction issued)."""
        return unit.reduction.reduce_issued or unit.reduction.ready

    def awaiting_backward(self, unit: ShardUnit) -> bool:
        """Backward has not yet reached the unit's gradients (none arrived, no use came back)."""
        return not (unit.reduction.ready or unit.reduction.bwd_done)

    def note_forward(self, unit: ShardUnit) -> None:
        """A unit's forward under grad mode (not a recomputation): count it in this step."""
        if self.backward_done:
            self.step += 1
            self.backward_done = False
        unit.reduction.note_forward(self.step)

    # ------------------------------------------------------------ reductions in order
    def on_unit_ready(self, unit: ShardUnit) -> None:
        """A unit's last gradient arrived: issue every reduction now due, in the fixed order."""
        order = self.reduce_order
        while self.next_reduce < len(order):
            u = order[self.next_reduce]
            if u.reduction.ready:
                u.reduction.reduce_grads()
            elif u.used_this_step():
                return  # an earlier unit in the order still waits for gradients
            self.next_reduce += 1

    # ------------------------------------------------------------ buffer pool
    def _cap(self, tag: str, numel: int) -> int:
        if tag not in self._caps:
            self._caps[tag] = max([u.buffer_numel(tag) for u in self.units] + [0])
        return max(self._caps[tag], numel)

    def acquire_buffer(
        self, unit: ShardUnit, numel: int, dtype: torch.dtype, device: torch.device, tag: str
    ) -> torch.Tensor:
        """A buffer of at least `numel` elements (a view of exactly `numel`); give it back with
        `release_buffer`. See [Note: the gradient buffer pool]."""
        key = (tag, dtype, device.type, device.index)
        while True:
            free = self._pool.setdefault(key, [])
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                buf = fits[0]
                del free[next(i for i, b in enumerate(free) if b is buf)]
                return buf[:numel] if buf.numel() != numel else buf
            if len(self.pending_units) >= MAX_IN_FLIGHT:
                self.pending_units.pop(0).reduction.finish_reduce()
                continue
            for small in free:  # a request above the cap (units added later): replace, never keep both
                self._owned.pop(id(small), None)
            free.clear()
            buf = torch.empty(self._cap(tag, numel), dtype=dtype, device=device)
            self._owned[id(buf)] = (key, buf)
            return buf[:numel] if buf.numel() != numel else buf

    def add_pending(self, unit: ShardUnit) -> None:
        """Track an issued reduction; finish the oldest ones so at most MAX_IN_FLIGHT hold memory."""
        self.pending_units.append(unit)
        while len(self.pending_units) > MAX_IN_FLIGHT:
            self.pending_units.pop(0).reduction.finish_reduce()

    def release_buffer(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        rec = self._owned.get(id(base))
        if rec is not None and rec[1] is base:  # else a buffer the pool dropped meanwhile: let it go
            self._pool.setdefault(rec[0], []).append(base)

    def pool_bytes(self) -> int:
        """Bytes of every pooled buffer, free or in use."""
        return sum(b.untyped_storage().nbytes() for _, b in self._owned.values())

    def pool_buffers(self) -> List[torch.Tensor]:
        return [b for _, b in self._owned.values()]

    # ------------------------------------------------------------ end of backward
    def finish_backward(self) -> None:
        """Final callback of the root: drain reductions, reshard everything, go idle."""
        with record_function("fsdp::finish_backward"):
            self.set_phase(TrainingPhase.POST_BACKWARD)
            # What the fixed order still holds (units waiting for an earlier one, units with
            # parameters unused on this rank): issue it now, in that order, on every rank alike.
            for u in self.reduce_order[self.next_reduce :]:
                if u.reduction.ready or (u.used_this_step() and (self.root_reached or u.reduction.bwd_reached)):
                    u.reduction.reduce_grads()
            self.next_reduce = 0
            self.root_reached = False
            while self.pending_units:
                self.pending_units.pop(0).reduction.finish_reduce()
            for dev in {u.compute_device for u in self.units if u.offload and u.compute_device.type == "cuda"}:
                torch.cuda.current_stream(dev).synchronize()  # offloaded grad shards were copied non-blocking
            for u in self.units:
                u.reshard_after_backward_step()
                u.reset_backward()
            self._release_pool_after_backward()
            self.callback_queued = False
            self.backward_done = True
            self.set_phase(TrainingPhase.IDLE)

    def _release_pool_after_backward(self) -> None:
        """Let go of the pool's buffers on devices that do not keep it (see [Note: the gradient
        buffer pool]); none is in use once the reductions are drained."""
        kept = lambda key: key[2] in POOL_KEPT_BETWEEN_STEPS_ON  # key: (tag, dtype, device type, index)
        self._pool = {key: free for key, free in self._pool.items() if kept(key)}
        self._owned = {i: rec for i, rec in self._owned.items() if kept(rec[0])}

    def reset_iter_state(self) -> None:
        """Back to the start of a step after an exception mid-step: wait for what is in flight,
        free every gathered parameter, forget this step's progress (reduced gradients stay)."""
        for u in self.units:
            if u._gather is not None:
                u.wait_unshard()
        while self.pending_units:
            self.pending_units.pop(0).reduction.finish_reduce()
        for u in self.units:
            u.reshard()
            u.reset_backward()
            u.reduction.forget_step()
        self.in_root_forward = self.root_reached = False
        self.next_reduce = 0
        self.callback_queued = self.in_parts = False
        self.backward_done = True
        if not self.order_frozen:  # a partly recorded first forward: record it again
            self.order.clear()
        self.phase = TrainingPhase.IDLE

    def reshard_all(self) -> None:
        for u in self.units:
            u.reshard()
