"""A unit's gradients: written into one flat buffer, reduce-scattered (async), averaged, and handed
to the sharded parameters' `.grad` views.

`GradReduction` is the object a `ShardUnit` (unit.py) holds as `unit.reduction` for backward's
side of the step: it owns the gradient state (the grad shard in flight, the no-sync accumulation,
the hybrid partial sum, the reduction in flight and this backward's progress) and runs
`pre_accumulate` and `on_grad` (leaf hooks), `reduce_grads` (issued by the context in the fixed
order of [Note: reductions in a fixed order on their own group] in context.py) and
`finish_reduce` (drained by the context). It reads the unit's storage (entries, layout, gathered
buffer) and never writes the unit's attributes.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
from torch.profiler import record_function

from . import collectives as C
from .api import UnitState
from .tree import TreeSum, tree_sum
from .views import ShardPiece
from .zeropp import dequantize_into, issue_quantized_reduce, packed_nbytes


class _Reduction(NamedTuple):
    """A unit's gradient reduction in flight (issued by reduce_grads, drained by finish_reduce)."""

    pending: C.Pending
    pooled_input: Optional[torch.Tensor]  # reduce-scatter input to give back to the pool
    direct: bool  # the output is the grad shard itself
    fresh: bool  # the sharded params had no .grad: assign views instead of accumulating
    post_divide: float  # divide the reduced shard by this (see grad_divide_factors)
    out: Optional[torch.Tensor]  # pooled output buffer when not direct
    in_place: bool  # the input is the unit's gathered storage: reshard when done
    scratch: Optional[torch.Tensor]  # reduce-scatter receive scratch to give back
    quantized: Optional[torch.Tensor]  # qgZ: the int8 chunks received, to dequantize and sum
    quantized_pooled: bool  # ... received into a pooled buffer (not inside the input)
    # deterministic mode: the rank's subtree sum sent by the all-to-all (kept alive until the wait)
    canonical: Optional[torch.Tensor] = None


def grad_divide_factors(dp: float, reduce_dtype: torch.dtype) -> Tuple[float, float]:
    """(divide before the sum, divide after it), whose product is the data-parallel size `dp`
    (or the factor of `set_gradient_divide_factor`), in FSDP2's order so that our reduced
    gradients are FSDP2's bit for bit where the sums are (two ranks per sum, or any sum of exact
    values): each rank's gradient is cast to the reduce dtype, divided by the first factor, summed
    in the reduce dtype, and the sum divided by the second, still in the reduce dtype, before it
    is cast to the shard's dtype.

    fp32 and bf16 (fp32's exponent range) sum first and divide once, as FSDP2's average does.
    fp16 can both overflow (summing first) and underflow (dividing the whole world first, e.g.
    1e-5 / 1024 is below fp16's smallest normal): the first factor is the power of two FSDP2
    takes, doubled while it divides `dp` and is below `dp` over it (2 of 4, 4 of 8, 32 of 1024, 2
    of 2), the rest after, so each side loses about sqrt(dp) of range. Powers of two divide exactly.
    """
    if dp <= 1 or reduce_dtype != torch.float16:
        return 1.0, float(dp)
    pre = 1
    while dp % pre == 0 and dp / pre > pre:
        pre *= 2
    return float(pre), dp / pre


# [Note: gradients reuse the gathered storage]
# Once a parameter's gradient is complete (summed over all its uses), backward never reads that
# parameter again. So a leaf hook copies each gradient into the parameter's own slot of the
# unit's gathered storage (pre_accumulate), and when the unit's last gradient is in, that storage
# is the reduce-scatter input; it is released when the reduce-scatter finishes (at most
# MAX_IN_FLIGHT units wait, see context.py). No separate gradient buffer exists, the peak during
# backward is one unit lower than with one, and between steps the engine holds only shards.
# Units with frozen parameters (which later backward ops may still read) or a reduce dtype that
# differs from the param dtype use a pooled buffer instead ([Note: the gradient buffer pool]).

# [Note: a unit not gathered in backward]
# `set_unshard_in_backward(False)` (FSDP2's, for modules whose backward reads no parameter, e.g.
# an embedding) skips the unit's gather in backward (and every prefetch of it, and hpZ's secondary
# shard, which only backward would read): under ZeRO-3 it stays sharded from the end of its
# forward. Autograd stores its full gradients on the unsharded parameters as usual (their storage
# is released, their shapes are not), and the reduction takes them from a pooled buffer, as for
# a unit holding frozen weights; unsharded in backward anyway (ZeRO-2, or a recomputation under
# activation checkpointing), it reduces in place as any unit.


class GradReduction:
    """Backward's side of a unit, held by it as `unit.reduction`."""

    def __init__(self, unit) -> None:
        self.unit = unit
        self.requires_grad_sync = True
        # FSDP2's per-module settings (sharded_module.py): the all-reduce over replicas (hybrid;
        # False keeps the reduce-scattered gradient as a partial sum, `partial`) and the factor the
        # summed gradients are divided by (None: the data-parallel size)
        self.requires_all_reduce = True
        self.partial: Optional[torch.Tensor] = None
        self.divide_factor: Optional[float] = None
        # [Note: one summation tree, whatever the layout] (canonical.py), set by
        # `set_deterministic_reduction`: each backward is one leaf of the tree (`tree`), the
        # synced one sends the rank's subtree to the shards' owners, who add in tree order
        self.deterministic = False
        self.tree = TreeSum()
        self._leaf: Optional[torch.Tensor] = None  # this backward's leaf, filled by pre_accumulate
        # entry indices of a group's parameters that get a gradient ([Note: a group of modules is
        # one unit] in unit.py)
        self.reached: set = set()
        # [Note: gradient shards live from backward to zero_grad]
        # The fp32 gradient shard is allocated when a backward's reduction needs it and handed
        # over to the sharded parameters' `.grad` views; nothing keeps a reference between
        # steps, so `zero_grad(set_to_none=True)` frees it (as FSDP2's per-parameter gradients
        # are freed) and forward and the early backward run without it. `grad_shard` is set
        # only while a reduction is in flight.
        self.grad_shard: Optional[torch.Tensor] = None
        self.accum: Optional[torch.Tensor] = None  # unsharded grads kept across no-sync micro-steps
        self._accum_valid = False
        self.pending: Optional[_Reduction] = None
        # Per step (see [Note: reductions in a fixed order on their own group], and [Note: frozen
        # parameters reshard after the unit's whole backward]):
        self.fwd_uses = 0  # forward calls of this step whose inputs carry the post-backward hook
        self.used_step = -1  # ctx.step of the unit's last forward under grad mode
        self.reset_backward()

    def note_forward(self, step: int) -> None:
        """The unit's forward under grad mode in step `step` (ShardContext.note_forward)."""
        if self.used_step != step:  # its first forward of this step
            self.fwd_uses = 0
        self.used_step = step

    def note_reached(self, member: Optional[nn.Module]) -> None:
        """Backward reached an output of the unit (of `member`, in a group)."""
        self.bwd_reached = True
        if member is not None:
            self.reached_member(member)

    def forget_step(self) -> None:
        """Back to the start of a step after an exception mid-step (ShardContext.reset_iter_state)."""
        self.fwd_uses = 0
        self.reached.clear()

    def reset_backward(self) -> None:
        """Forget this backward's progress (the context calls it when backward ends)."""
        self.bwd_reached = False  # this backward reached the unit (its outputs, or a gradient)
        self._grads_seen = 0
        self.reduce_issued = False
        self.ready = False  # every trainable gradient of this backward has arrived
        self.bwd_done = 0  # of the forward uses, how many have finished their backward
        self._written = [False] * len(self.unit.entries)  # grad already written in place this backward

    def drop_accumulated(self) -> None:
        """Forget the gradients kept across no-sync micro-steps (the unit moved)."""
        self.grad_shard = self.accum = None
        self._accum_valid = False
        self.tree = TreeSum()
        self._leaf = None

    # [Note: frozen parameters reshard after the unit's whole backward]
    # A unit whose parameters are all trainable is done with them once its last gradient is in
    # (see [Note: gradients reuse the gathered storage]). A frozen parameter has no gradient to
    # say so: a frozen layer run before a trainable one in forward is still needed by backward
    # after the trainable one's gradient arrived. Such a unit therefore reshards when its whole
    # backward is done, as FSDP2 does: the forward pre-hook passes the unit's inputs through an
    # identity autograd function (hooks.py) whose backward runs after everything the unit
    # computed; once every forward use of this step has come back, the unit reshards. Uses whose
    # inputs need no gradient never come back; the final callback reshards those units.
    # The input's gradient can also come back before the unit's own trainable gradients: a
    # tensor-parallel parameter whole on every rank (LoRA's A beside a column-wise base) gets its
    # gradient through DTensor's from_local backward (an all-reduce of the ranks' partial sums),
    # a node autograd runs after the input's path. So the unit reshards when both are in; the
    # last gradient's reduction reshards it otherwise (`_backward_done`).
    def note_forward_use(self) -> None:
        """A forward under grad mode whose inputs carry the post-backward hook (frozen units)."""
        self.fwd_uses += 1

    def post_backward(self) -> None:
        """The backward of one forward use is complete (see the note above)."""
        self.bwd_done += 1
        grads_in = self.ready or not self.unit.trainable or self.reduce_issued
        done = grads_in and self.bwd_done >= self.fwd_uses
        if done and self.unit.state != UnitState.SHARDED and self._pending_reshard_ok():
            with record_function("fsdp::post_backward_reshard"):
                self.unit.reshard_after_backward_step()

    def _pending_reshard_ok(self) -> bool:
        # an in-place reduction still reads the gathered storage; it reshards when it finishes
        return self.pending is None or not self.pending.in_place

    def _backward_done(self) -> bool:
        return not self.unit.has_frozen or (self.fwd_uses > 0 and self.bwd_done >= self.fwd_uses)

    def _in_place_this_backward(self) -> bool:
        return (
            not self.deterministic and self.requires_grad_sync and not self._accum_valid and self._can_reduce_in_place()
        )

    def pre_accumulate(self, idx: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Leaf hook, before autograd stores the full parameter's gradient.

        With in-place reduction (see [Note: gradients reuse the gathered storage]) the gradient is
        written straight into the parameter's own slot of the gathered storage, and that slot is
        handed to autograd to store: one copy, which also fixes the layout of transposed weight
        gradients (which autograd would otherwise clone into the parameter's layout first).
        Under the deterministic mode the slot is this backward's leaf of the tree instead (the
        buffer `_reduce_canonical` pushes), whatever the unit's storage.
        """
        if (
            self.unit.members is not None
        ):  # a group: this parameter gets a gradient ([Note: a group of modules is one unit])
            self.reached.add(idx)
        if self._written[idx]:
            return None
        e = self.unit.entries[idx]
        if self.deterministic and grad.dtype == self.unit.reduce_dtype:
            # this backward's leaf of the tree: each gradient straight into its slot, as above
            if self._leaf is None:
                u = self.unit
                self._leaf = torch.empty(u.layout.padded_total, dtype=u.reduce_dtype, device=u.compute_device)
            dst = self._leaf[e.offset : e.offset + e.numel].view(e.shape)
        elif self._in_place_this_backward():
            dst = self.unit.full_flat[e.offset : e.offset + e.numel].view(e.shape)
        else:
            return None
        with torch.no_grad():
            dst.copy_(grad)
        self._written[idx] = True
        return dst

    def on_grad(self) -> None:
        """Post-accumulate-grad of one trainable full parameter; after the last one the unit is
        ready, and the context issues its reduction in the model's fixed order."""
        self._grads_seen += 1
        self.bwd_reached = True
        if self._grads_seen == len(self.unit.trainable):
            self.ready = True
            self.unit.ctx.on_unit_ready(self.unit)

    def reduce_grads(self) -> None:
        """Put the unit's full grads in one flat buffer and issue the reduce-scatter (async).

        Called by the context only (in the fixed order of [Note: reductions in a fixed order on
        their own group]); a parameter without a gradient on this rank contributes zeros."""
        if self.reduce_issued or not self.unit.trainable:
            return
        self.reduce_issued = True
        L = self.unit.layout
        if self.deterministic:
            self._reduce_canonical()
            return
        if not self.requires_grad_sync:
            if self.accum is None:
                self.accum = torch.zeros(L.padded_total, dtype=self.unit.reduce_dtype, device=self.unit.compute_device)
            self._write_grads(self.accum, accumulate=self._accum_valid)
            self._accum_valid = True
            if self._backward_done():
                self.unit.reshard_after_backward_step()
            return
        in_place = False
        with record_function("fsdp::copy_grads"):
            if self._accum_valid:
                self._write_grads(self.accum, accumulate=True)
                buf, pooled = self.accum, False
            elif self._can_reduce_in_place():
                buf, pooled, in_place = self.unit.full_flat, False, True
                self._write_grads(buf, accumulate=False)
            else:
                buf = self.unit.ctx.acquire_buffer(
                    self.unit, L.padded_total, self.unit.reduce_dtype, self.unit.compute_device, "in"
                )
                self._write_grads(buf, accumulate=False)
                pooled = True
        pre, post = grad_divide_factors(self.divide_factor or self.unit.dp, self.unit.reduce_dtype)
        if pre != 1.0:
            buf.div_(pre)  # see grad_divide_factors: fp16 sums must not overflow
        fresh = all(p.grad is None for p in self._trainable_sharded())
        direct = fresh and buf.dtype == self.unit.shard_dtype and self._grad_device() == buf.device
        quant = self.unit.comm is not None and self.unit.comm.grads and self.unit.N > 1
        scratch = q_recv = None
        q_pooled = False
        if quant:  # the chunks are summed in fp32: straight into the grad shard when it is fp32 and fresh
            direct = fresh and self.unit.shard_dtype == torch.float32 and self._grad_device() == buf.device
            if direct:
                self.grad_shard = self._new_grad_shard()
            out = (
                self.grad_shard
                if direct
                else self.unit.ctx.acquire_buffer(
                    self.unit, L.shard_numel, torch.float32, self.unit.compute_device, "q"
                )
            )
            u = self.unit
            acquire = lambda n: u.ctx.acquire_buffer(u, n, torch.uint8, u.compute_device, "qrecv")
            pending, q_recv, q_pooled = issue_quantized_reduce(
                buf, u.N, u.layout.shard_numel, u.comm.block_size, u.reduce_group, u.stats, u.name, acquire
            )
        else:
            if direct:
                self.grad_shard = self._new_grad_shard()
            out = (
                self.grad_shard
                if direct
                else self.unit.ctx.acquire_buffer(
                    self.unit, L.shard_numel, self.unit.reduce_dtype, self.unit.compute_device, "out"
                )
            )
            transport = self.unit.transports()[1]
            k = transport.scratch_numel(L.shard_numel)
            scratch = (
                self.unit.ctx.acquire_buffer(self.unit, k, buf.dtype, self.unit.compute_device, "rs") if k else None
            )
            pending = C.reduce_scatter(out, buf, transport, self.unit.stats, self.unit.name, scratch)
        self.pending = _Reduction(
            pending=pending,
            pooled_input=buf if pooled else None,
            direct=direct,
            fresh=fresh,
            post_divide=post,
            out=None if direct else out,
            in_place=in_place,
            scratch=scratch,
            quantized=q_recv,
            quantized_pooled=q_pooled,
        )
        if in_place:
            self.unit._hide()  # the storage now holds gradients; resharded when the reduction finishes
        elif self._backward_done():
            self.unit.reshard_after_backward_step()
        self.unit.ctx.add_pending(self.unit)

    def _reduce_canonical(self) -> None:
        """[Note: one summation tree, whatever the layout]: this backward's full gradients are the
        next leaf of the rank's subtree; a synced backward sends the subtree's N pieces to their
        owners (an all-to-all's bytes, a reduce-scatter's), who add them in tree order."""
        u, L = self.unit, self.unit.layout
        leaf, self._leaf = self._leaf, None  # the gradients pre_accumulate wrote in already
        if leaf is None:
            leaf = torch.empty(L.padded_total, dtype=u.reduce_dtype, device=u.compute_device)
        with record_function("fsdp::copy_grads"):
            self._write_grads(leaf, accumulate=False)
            self.tree.push(leaf)
        if self.requires_grad_sync:
            local = self.tree.total()
            fresh = all(p.grad is None for p in self._trainable_sharded())
            if u.N > 1:
                # the group's transport: shared memory between the processes of one host, with
                # the tree's adds read straight from it (no full-size receive buffer)
                out = torch.empty(L.shard_numel, dtype=local.dtype, device=local.device)
                pending = C.tree_reduce_scatter(out, local, u.transports()[1], u.stats, u.name)
            else:
                pending = C.Pending(None, local, u.stats)
            self.pending = _Reduction(
                pending=pending,
                pooled_input=None,
                direct=False,
                fresh=fresh,
                post_divide=1.0,  # the loss carries the global normalisation
                out=None,
                in_place=False,
                scratch=None,
                quantized=None,
                quantized_pooled=False,
                canonical=local,
            )
        if self._backward_done():
            u.reshard_after_backward_step()
        if self.requires_grad_sync:
            u.ctx.add_pending(u)

    def _finish_canonical(self, red: _Reduction) -> torch.Tensor:
        """The owner's side of `_reduce_canonical`: the N pieces (summed in tree order by the
        transport), then the R replicas'."""
        u = self.unit
        reduced = C.wait(red.pending)  # the N pieces in tree order (C.tree_reduce_scatter)
        S = u.layout.shard_numel
        if u.R > 1:
            transport = C.transport_for(u.replicate_group, reduced.device)
            every = torch.empty(u.R * S, dtype=reduced.dtype, device=reduced.device)
            gathered = C.wait(C.all_gather(every, reduced.contiguous(), transport, u.stats, u.name))
            reduced = tree_sum(list(gathered.view(u.R, S).unbind()))
        return reduced

    def _can_reduce_in_place(self) -> bool:
        """All params trainable and same dtype: once the last grad arrived, backward no longer reads
        the gathered params, so the gathered storage can be the reduce-scatter input."""
        return (
            self.unit.storage is not None
            and self.unit.reduce_dtype == self.unit.param_dtype
            and len(self.unit.trainable) == len(self.unit.entries)
            and self.unit.state == UnitState.UNSHARDED
            and self.unit.reshard_after_backward  # else the gathered parameters must survive backward
        )

    def _write_grads(self, buf: torch.Tensor, accumulate: bool) -> None:
        L = self.unit.layout
        with torch.no_grad():
            for i, (e, full) in enumerate(zip(self.unit.entries, self.unit.full_params)):
                g = full.grad if e.requires_grad else None
                if self._written[i]:  # already in place (pre_accumulate)
                    full.grad = None
                    continue
                dst = buf[e.offset : e.offset + e.numel]
                if g is None:
                    if not accumulate:
                        dst.zero_()
                else:
                    dst.add_(g.view(-1)) if accumulate else dst.copy_(g.reshape(-1))
                    full.grad = None
            if not accumulate:
                for lo, hi in L.gaps:  # padding: between parameters under a boundary policy, and at the end
                    buf[lo:hi].zero_()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter, all-reduce over replicas, average, expose `.grad` views."""
        if self.pending is None:
            return
        red = self.pending
        self.pending = None
        if red.canonical is not None:
            self._hand_over(red, self._finish_canonical(red), None)
            return
        C.wait(red.pending)
        out = red.out
        if red.quantized is not None:  # sum the dequantized chunks before their buffer goes back
            b, S = self.unit.comm.block_size, self.unit.layout.shard_numel
            nb = packed_nbytes(S, b)
            total = self.grad_shard if red.direct else out
            with record_function("fsdp::dequantize"):
                for r in range(self.unit.N):
                    dequantize_into(red.quantized[r * nb : (r + 1) * nb], total, b, accumulate=r > 0)
            if red.quantized_pooled:
                self.unit.ctx.release_buffer(red.quantized)
        if red.in_place:
            self.unit.reshard()
        if red.scratch is not None:
            self.unit.ctx.release_buffer(red.scratch)
        if red.pooled_input is not None:
            self.unit.ctx.release_buffer(red.pooled_input)
        if self._accum_valid:
            # the accumulated grads went into this reduction: free them until the next no-sync step
            self._accum_valid = False
            self.accum = None
        reduced = self.grad_shard if red.direct else out
        if self.unit.R > 1:
            if self.partial is not None:  # reduce-scattered without the all-reduce before (set_requires_all_reduce)
                reduced.add_(self.partial.to(reduced.dtype))
                self.partial = None
            if not self.requires_all_reduce:
                self.partial = reduced.clone()
                if red.direct:
                    self.grad_shard = None
                if out is not None:
                    self.unit.ctx.release_buffer(out)
                return
            C.wait(C.all_reduce(reduced, self.unit.replicate_group, self.unit.stats, self.unit.name))
        if red.post_divide != 1.0:
            reduced.div_(red.post_divide)
        self._hand_over(red, reduced, out)

    def _hand_over(self, red: _Reduction, reduced: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        """The reduced shard to the sharded parameters' `.grad` views (or added to them), and their
        post-accumulate-grad hooks; `out` (a pooled buffer) goes back to the pool."""
        receiving = self._receiving()
        params = [p for p, _ in receiving]
        with torch.no_grad():
            if red.fresh:
                if not red.direct:
                    self.grad_shard = self._new_grad_shard()
                    self.grad_shard.copy_(reduced, non_blocking=True)
                for p, e in receiving:
                    p.grad = ShardPiece(self.grad_shard[self.unit.layout.shard_slice(e)], p.piece_spec)
                self.grad_shard = None  # the .grad views own it now (see the note in __init__)
            else:
                # gradients persist (zero_grad(set_to_none=False), or a second synced backward):
                # accumulate where they live, so bring the reduced shard there first (CPU offload
                # keeps them on the host, the reduction ran on the compute device)
                host = reduced.to(self._grad_device())
                for p, e in receiving:
                    piece = host[self.unit.layout.shard_slice(e)].to(p.dtype)
                    if p.grad is None:
                        p.grad = ShardPiece(piece.clone(), p.piece_spec)
                    else:
                        p.grad.add_(piece)
        if out is not None:
            self.unit.ctx.release_buffer(out)
        # Autograd never accumulates into the sharded parameters (the modules compute with the
        # unsharded ones), so their post-accumulate-grad hooks run here, once the reduced gradient
        # is in place (as in FSDP2): e.g. an optimizer stepped per parameter inside backward.
        for p in params:
            for hook in tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)

    def _receiving(self) -> List[Tuple[nn.Parameter, object]]:
        """(sharded parameter, entry) of each trainable parameter this reduction hands a gradient
        to: all of them, or in a group those of the members the backward reached ([Note: a group of
        modules is one unit]); the group's record of them starts again."""
        pairs = zip(self.unit.sharded_params, self.unit.entries)
        if self.unit.members is None:
            return [(p, e) for p, e in pairs if e.requires_grad]
        reached, self.reached = self.reached, set()
        return [(p, e) for i, (p, e) in enumerate(pairs) if e.requires_grad and i in reached]

    def reached_member(self, module: nn.Module) -> None:
        """The backward reached an output of `module`, a member of this group: its parameters get
        gradients from the next synced reduction."""
        k = next(k for k, m in enumerate(self.unit.members) if m is module)
        self.reached.update(i for i, e in enumerate(self.unit.entries) if k in e.members)

    def _grad_device(self) -> torch.device:
        return self.unit.shard.device

    def _new_grad_shard(self) -> torch.Tensor:
        pin = self.unit.offload and self.unit.compute_device.type == "cuda"
        return torch.empty(
            self.unit.layout.shard_numel, dtype=self.unit.shard_dtype, device=self._grad_device(), pin_memory=pin
        )

    def grad_bytes(self) -> int:
        """Bytes of the gradients this unit's sharded parameters hold now (each storage once)."""
        seen = {}
        for p in self._trainable_sharded():
            if p.grad is not None:
                st = p.grad.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        if self.grad_shard is not None:
            seen[self.grad_shard.untyped_storage().data_ptr()] = self.grad_shard.untyped_storage().nbytes()
        return sum(seen.values())

    def _trainable_sharded(self) -> List[nn.Parameter]:
        return [p for p, e in zip(self.unit.sharded_params, self.unit.entries) if e.requires_grad]
