"""One unit: the parameters gathered and reduced together (one `fully_shard` call).

Owns the fp32 shard buffer (the optimizer's parameters are views into it), allocates the fp32
gradient shard in backward (their `.grad` views own it until zero_grad), holds the unsharded
storage that the modules compute with, and runs the unit's part of the step: unshard, reshard,
reduce gradients, finish the reduction.
See [Note: flat storage] in flat.py.
"""

from __future__ import annotations

import weakref
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from . import collectives as C
from .api import MixedPrecisionPolicy, QuantizedCommPolicy, UnitContext, UnitState
from .codec import GatherCodec
from .flat import FlatEntry, FlatLayout, contiguous_stride
from .reduce import GradReduction
from .transport import Transport
from .views import PieceSpec, ShardPiece
from .zeropp import packed_nbytes

# [Note: records of sharded parameters]
# What the engine knows about a sharded parameter (its unit, its entry) is part of the parameter:
# a `ShardPiece` carries its `piece_spec` (views.py, [Note: pieces that describe themselves]), and
# every elementwise result of it (`.to()`, `to_empty()`'s `empty_like`, `zeros_like`) carries it
# on, so `module.to()` and `torch.utils.swap_tensors` keep it with no table to update. Only the
# original (pre-sharding) parameters are recorded, weakly, to refuse sharding one twice. That
# record is process-wide on purpose: the mistake it catches (a tied or shared parameter passed to
# two `fully_shard` calls, on modules of one model or of two) spans calls that share no object of
# ours, and the key is the user's tensor, not ours. Its keys are weak: it holds nothing alive and
# forgets a parameter when the user drops it, so no owner has anything to free. Ranks that are
# threads of one process each shard their own model, so they claim distinct tensors; nothing in it
# depends on which rank or world asks ([Note: engine state per world, not per process] in mesh.py).
_CLAIMED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original (pre-sharding) parameter -> owning unit's name


def owner_of(param: torch.Tensor) -> Optional[Tuple["ShardUnit", int]]:
    """(unit, entry index) of a parameter our engine sharded (or of its gradient or optimizer
    state), None for any other tensor."""
    return param.piece_spec.owner() if isinstance(param, ShardPiece) else None


def piece_spec(unit: "ShardUnit", index: int) -> PieceSpec:
    """The description the pieces of the unit's entry `index` carry (views.py)."""
    return PieceSpec(weakref.ref(unit), index, unit.entries[index].global_shape, unit.norm_share(index))


def claimed_by(param: torch.Tensor) -> Optional[str]:
    """The unit that already took `param` (an original parameter replaced by its shard), if any."""
    return _CLAIMED.get(param)


def claim(param: torch.Tensor, owner: str) -> None:
    _CLAIMED[param] = owner


def sharded_units(module: nn.Module) -> List["ShardUnit"]:
    """The units at and below `module`, in module order (the same on every rank); a group's unit
    (fully_shard([m1, m2])) once, where its first member is."""
    found = [m._fsdp_unit for m in module.modules() if getattr(m, "_fsdp_unit", None) is not None]
    return list({id(u): u for u in found}.values())


# [Note: unsharded storage keeps its identity]
# Autograd saves the full parameters (and views of them, e.g. `weight.t()` inside linear) for
# backward. So a unit's unsharded parameters are created once, as tensors over one untyped storage
# per unit, and stay the same objects for the life of the model. Resharding releases the memory
# with `storage.resize_(0)`; unsharding resizes it back and gathers into it, so every saved tensor
# and view sees the re-gathered values. This per-unit block is the one allocation on the gather
# path: the caching allocator (CUDA) hands the same block back from step 2 on; on CPU glibc may
# return large blocks to the OS, so a re-gather can page-fault (measured: ~40K minor faults per
# step on the 27M bench model, about what DDP shows), which is the price of freeing memory at all.
# Send buffers (casts, int8 packing) and reduce-scatter scratch are allocated once and reused.
# With one rank in the shard group and no dtype change (NO_SHARD fp32), the unsharded storage *is*
# the shard buffer: no gather, no copy, never released.


class ShardUnit:
    """One `fully_shard` call's parameters: storage, state machine and gather here; it holds
    backward's reduction (`reduction`, reduce.py's `GradReduction`) and the gather's encoding
    (`codec`, codec.py's `GatherCodec`: plain, int8, float8, hpZ), each owning its own state."""

    def __init__(
        self,
        module: nn.Module,
        *,
        entries: List[FlatEntry],
        layout: FlatLayout,
        shard_group: dist.ProcessGroup,
        reduce_group: Optional[dist.ProcessGroup],
        replicate_group: Optional[dist.ProcessGroup],
        mesh,
        reshard_after_forward: bool,
        mp: MixedPrecisionPolicy,
        offload: bool,
        comm: Optional[QuantizedCommPolicy],
        compute_device: torch.device,
        shard_dtype: torch.dtype,
    ) -> None:
        self.module = module
        self.name = type(module).__name__
        self.entries = entries
        self.layout = layout
        self.shard_group = shard_group
        # the same ranks as shard_group, for gradient reductions only: see [Note: reductions in a
        # fixed order on their own group] in context.py
        self.reduce_group = reduce_group if reduce_group is not None else shard_group
        self.replicate_group = replicate_group
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        self.comm = comm
        self.compute_device = compute_device
        self.offload = offload
        self.N = layout.world
        self.R = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.dp = self.N * self.R
        self.rank = dist.get_rank()
        self.param_dtype = mp.param_dtype or shard_dtype
        self.reduce_dtype = mp.reduce_dtype or self.param_dtype
        self.shard_dtype = shard_dtype
        self.state = UnitState.SHARDED
        self.state_mesh = mesh  # checkpoint DTensors live here (the (dp..., tp) mesh under TP)
        self.tp_size = 1
        self.outer_copies = 1  # groups of ranks outside `mesh` and TP holding the same pieces (set_norm_copies)
        self.ctx: Optional[UnitContext] = None
        self.stats = C.CommStats()
        # FSDP2's per-module settings (sharded_module.py; the gradient ones are `reduction`'s):
        # freeing the gathered parameters after backward, whether the user set
        # reshard_after_forward (then the root keeps it), and a forward method running
        # (register_fsdp_forward_method)
        self.reshard_after_backward = True
        self.unshard_in_backward = True  # False: not gathered again in backward (set_unshard_in_backward)
        self.reshard_after_forward_set = False
        self.in_method = False
        # [Note: a group of modules is one unit]
        # fully_shard([m1, m2]) shards the parameters of several modules as one unit (FSDP2's
        # grouping): each member gets the forward hooks; the first member to run forward in a pass
        # gathers (and prefetches), the others find the unit gathered, and it is freed after
        # forward (ZeRO-3) once every member has run (`members_run`, reset then and when the unit
        # is resharded for any other reason). A member may not run in the root's forward (a
        # chunked loss calls the head on its own afterwards, once per chunk): the root's
        # post-forward then completes the group's forward (frees it under ZeRO-3), as FSDP2 does,
        # and a member called on its own later gathers the unit again and keeps it until the end
        # of its backward. The unit's reduction covers all its parameters, but a parameter gets a
        # gradient only if the backward reached a member that uses it (a hook on that member's
        # outputs) or its own gradient arrived (`reduction.reached`, entry indices, kept until a synced
        # reduction hands the gradients over): a member that did not run, or whose outputs this
        # backward did not reach, leaves its parameters' `.grad` as it was (None, as FSDP2 does)
        # instead of adding zeros. Which members a backward reaches must be the same on every rank
        # (as FSDP2 requires of the parameters that get gradients).
        self.members: Optional[List[nn.Module]] = None
        self.members_run: set = set()
        self.standalone = False  # its last forward ran outside the root's: no implicit prefetch (hooks.py)
        # units gathered ahead of this one's forward / backward when set explicitly; None = the
        # recorded forward order (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)
        self.forward_prefetch: Optional[List["ShardUnit"]] = None
        self.backward_prefetch: Optional[List["ShardUnit"]] = None
        self.refresh_trainable()
        shard_device = torch.device("cpu") if offload else compute_device
        pin = offload and compute_device.type == "cuda"
        self.shard = torch.zeros(layout.shard_numel, dtype=shard_dtype, device=shard_device, pin_memory=pin)
        self.sharded_params: List[nn.Parameter] = []
        self.full_params: List[torch.Tensor] = []
        self._gather: Optional[C.Pending] = None
        self._transports: Optional[Tuple[Transport, Transport, Optional[Transport]]] = None
        self.reduction = GradReduction(self)
        self.codec = GatherCodec(self)
        self._build_full_storage()

    # [Note: requires_grad is read at every step]
    # Users freeze and unfreeze the sharded parameters they see (`p.requires_grad_(False)` on the
    # wrapped model, the usual order when fine-tuning), at any time between steps. The engine works
    # from each entry's `requires_grad` (which gradients to wait for, what to reduce, which
    # unsharded parameters autograd tracks), so the root's forward first copies the sharded
    # parameters' flags onto the entries and the unsharded parameters (`sync_requires_grad`); a
    # change re-derives the unit's trainable set, hooks newly trainable parameters and rebuilds the
    # model's reduction order and buffer sizes (ShardContext.trainable_changed). As in FSDP2, a
    # parameter frozen after sharding gets no gradient and is not moved by the optimizer, and one
    # unfrozen after sharding trains.
    def sync_requires_grad(self) -> bool:
        """Take each sharded parameter's `requires_grad` (see the note above); True if one changed.
        Call between steps only."""
        changed = False
        for e, sp, full in zip(self.entries, self.sharded_params, self.full_params):
            if sp.requires_grad != e.requires_grad:
                e.requires_grad = sp.requires_grad
                full.requires_grad_(e.requires_grad)
                changed = True
        if changed:
            self.refresh_trainable()
        return changed

    def refresh_trainable(self) -> None:
        """Re-derive the trainable entries from each entry's `requires_grad` (see the note above)."""
        self.trainable = [e for e in self.entries if e.requires_grad]
        self.has_frozen = len(self.trainable) < len(self.entries)

    # ---------------------------------------------------------------- construction
    def _zero_copy(self) -> bool:
        # A unit without parameters of its own (e.g. a root whose blocks are all units) has
        # nothing to gather: it never communicates and never allocates (FSDP2 skips it too).
        return not self.entries or (self.N == 1 and self.param_dtype == self.shard_dtype and not self.offload)

    def _build_full_storage(self) -> None:
        L = self.layout
        if self._zero_copy():
            self.full_flat = self.shard
            self.storage = None
        else:
            self.full_flat = torch.empty(L.padded_total, dtype=self.param_dtype, device=self.compute_device)
            self.storage = self.full_flat.untyped_storage()
        base = self.full_flat.untyped_storage()
        self.full_params = []
        self.hooked: set = set()  # indices of full_params whose gradient hooks are registered (hooks.py)
        self._tp_views: List[Optional[DTensor]] = [None] * len(self.entries)
        for e in self.entries:
            t = torch.empty(0, dtype=self.param_dtype, device=self.compute_device)
            with torch.no_grad():
                t.set_(base, e.offset, e.shape, contiguous_stride(e.shape))
            t.requires_grad_(e.requires_grad)
            self.full_params.append(t)
        if self.storage is not None:
            # after the views: `set_` grows a storage to fit the view it is given, so releasing
            # first would leave every unit holding its full parameters from construction on
            self.storage.resize_(0)

    def buffer_numel(self, tag: str) -> int:
        """Elements this unit asks the model's pool for under `tag` (see [Note: the gradient
        buffer pool]); the pool cuts every buffer of a tag to the largest unit's size."""
        L = self.layout
        if not self.trainable:
            return 0
        if tag == "in":
            return L.padded_total
        if tag in ("out", "q"):
            return L.shard_numel
        if tag == "rs":
            return self.transports()[1].scratch_numel(L.shard_numel)
        if tag == "qrecv":
            quantized = self.comm is not None and self.comm.grads
            return self.N * packed_nbytes(L.shard_numel, self.comm.block_size) if quantized else 0
        raise KeyError(tag)

    def transports(self) -> Tuple[Transport, Transport, Optional[Transport]]:
        """(gather, reduce, hpZ secondary gather) transports of this unit's groups, chosen on first
        use (see [Note: one transport per group] in transport.py): the context asks for every
        unit's at lazy init, so no collective of the step ever has to choose one."""
        if self._transports is None:
            dev = self.compute_device
            hpz = self.codec.hpz
            secondary = C.transport_for(hpz[0], dev) if hpz is not None else None
            self._transports = (
                C.transport_for(self.shard_group, dev),
                C.transport_for(self.reduce_group, dev),
                secondary,
            )
        return self._transports

    def set_sharded_param(self, index: int, param: nn.Parameter) -> None:
        """Record `param` as entry `index`'s sharded piece (see [Note: records of sharded parameters])."""
        if index < len(self.sharded_params):
            self.sharded_params[index] = param
        else:
            assert index == len(self.sharded_params)
            self.sharded_params.append(param)

    def norm_share(self, index: int) -> int:
        """How many ranks hold an identical copy of entry `index`'s local piece (gradient clipping
        divides its squared norm by this): the replicas, times the tensor-parallel ranks unless TP
        splits the parameter, times `outer_copies`."""
        e = self.entries[index]
        tp_sharded = e.tp is not None and any(not pl.is_replicate() for pl in e.tp.placements)
        return self.R * (1 if tp_sharded else self.tp_size) * self.outer_copies

    def set_outer_copies(self, copies: int) -> None:
        """`outer_copies`, and the pieces' descriptions that carry it (their gradients take the
        parameter's): before the first backward."""
        self.outer_copies = int(copies)
        for i, e in enumerate(self.entries):
            for module, name, _ in e.users:
                param = module._parameters[name]
                if isinstance(param, ShardPiece):
                    param.piece_spec = piece_spec(self, i)

    def rebind_after_apply(self, fn) -> None:
        """After `module.to(...)` / `to_empty(...)` / `.double()` (`fn`, as passed to `_apply`)
        replaced the sharded parameters' data: rebuild the shard buffers on the new device/dtype
        from the parameters' new values, make the parameters views into them again, record the
        (possibly new) Parameter objects, and rebuild the unsharded storage.

        Call between steps only (no gather or reduction in flight).
        """
        assert self.state == UnitState.SHARDED and self.reduction.pending is None, (
            f"[rank {self.rank}] unit {self.name}: moved while {self.state.value}; move the model between steps"
        )
        params = [e.users[0][0]._parameters[e.users[0][1]] for e in self.entries]
        if not params:  # nothing of its own: only follow the move (the device its inputs go to)
            self.shard = fn(self.shard)
            self.compute_device = self.shard.device
            self.shard_dtype = self.shard.dtype
            self.full_flat = self.shard
            return
        device, dtype = params[0].device, params[0].dtype
        self.compute_device = device
        shard_device = torch.device("cpu") if self.offload else device
        pin = self.offload and device.type == "cuda"
        if self.mp.param_dtype is None:
            self.param_dtype = dtype
        if self.mp.reduce_dtype is None:
            self.reduce_dtype = self.param_dtype
        self.shard_dtype = dtype
        S = self.layout.shard_numel
        self.shard = torch.zeros(S, dtype=dtype, device=shard_device, pin_memory=pin)
        self.reduction.drop_accumulated()
        with torch.no_grad():
            for i, (e, sp) in enumerate(zip(self.entries, params)):
                view = self.shard[self.layout.shard_slice(e)]
                view.copy_(sp.detach().reshape(-1))
                sp.data = view
                sp.grad = None
                for mod, name, _ in e.users:
                    mod._parameters[name] = sp
                self.set_sharded_param(i, sp)
        self._transports = None  # chosen again for the new device on first use
        self.codec.reset()  # the param dtype's size places the packed pieces
        self._build_full_storage()  # new unsharded params: the caller re-registers their hooks

    def assert_state(self, *allowed: UnitState, what: str) -> None:
        assert self.state in allowed, (
            f"[rank {self.rank}] unit {self.name}: {what} needs state in "
            f"{[s.value for s in allowed]} but it is {self.state.value}"
        )

    def set_state(self, new: UnitState) -> None:
        legal = {
            UnitState.SHARDED: (UnitState.UNSHARDING, UnitState.UNSHARDED),
            UnitState.UNSHARDING: (UnitState.UNSHARDED,),
            UnitState.UNSHARDED: (UnitState.SHARDED,),
        }
        assert new in legal[self.state], (
            f"[rank {self.rank}] unit {self.name}: illegal transition {self.state.value} -> {new.value}"
        )
        self.state = new

    # ---------------------------------------------------------------- gather
    def unshard(self) -> None:
        """Issue the all-gather (async); `wait_unshard` exposes the result."""
        if self.state != UnitState.SHARDED:
            return
        if self._zero_copy():
            self.set_state(UnitState.UNSHARDED)
            self._expose()
            return
        L = self.layout
        self.storage.resize_(L.padded_total * self.full_flat.element_size())
        self._gather = self.codec.issue()
        self.set_state(UnitState.UNSHARDING)

    def wait_unshard(self) -> None:
        if self.state == UnitState.SHARDED:
            self.unshard()
        if self.state == UnitState.UNSHARDED:
            return
        C.wait(self._gather)
        self._gather = None
        self.codec.finish()
        self.set_state(UnitState.UNSHARDED)
        self._expose()

    def _expose(self) -> None:
        # The modules read the full parameter through the instance __dict__, which Python consults
        # before nn.Module.__getattr__ (and so before _parameters, which keeps the sharded piece
        # that named_parameters() and the optimizer see).
        grad = torch.is_grad_enabled()
        for i, (e, full) in enumerate(zip(self.entries, self.full_params)):
            if e.tp is not None:
                # [Note: tensor parallel composition] the engine shards the TP-local tensor over
                # the dp mesh; the module gets back the full-over-dp, still TP-sharded DTensor, made
                # with the differentiable from_local, so gradients arrive as local tensors on
                # `full` and take the same reduce-scatter path as plain parameters.
                # [Note: the recomputed forward sees the forward's DTensors] A forward under grad
                # mode makes the DTensors afresh and keeps them; a re-exposure without grad mode
                # (backward's re-gather after a ZeRO-3 reshard, an eval forward) reuses them. A
                # DTensor made inside backward would have no autograd edge to `full`, so an
                # activation-checkpointed block would recompute a different graph (fewer saved
                # tensors) and lose its weight gradients.
                cached = self._tp_views[i]
                if grad or cached is None:
                    cached = DTensor.from_local(
                        full, e.tp.mesh, e.tp.placements, run_check=False, shape=e.tp.shape, stride=e.tp.stride
                    )
                    self._tp_views[i] = cached
                full = cached
            for mod, attr, _ in e.users:
                mod.__dict__[attr] = full

    def _hide(self) -> None:
        for e in self.entries:
            for mod, attr, _ in e.users:
                mod.__dict__.pop(attr, None)

    def reshard(self) -> None:
        self.members_run.clear()
        if self.state == UnitState.UNSHARDING:
            self.wait_unshard()
        if self.state == UnitState.SHARDED:
            return
        self._hide()
        if self.storage is not None:
            self.storage.resize_(0)
        self.set_state(UnitState.SHARDED)

    def reshard_after_forward_step(self) -> None:
        """Forward is done with the gathered parameters: free them, keeping hpZ's secondary shard
        ([Note: hpZ secondary shards] in codec.py), not for a unit that backward does not gather
        (set_unshard_in_backward(False))."""
        if self.state == UnitState.UNSHARDED and self.unshard_in_backward:
            self.codec.keep_secondary()
        self.reshard()

    def reshard_after_backward_step(self) -> None:
        """Backward is done with the gathered parameters: free them, unless
        `set_reshard_after_backward(False)` keeps them for the next forward."""
        if self.reshard_after_backward:
            self.reshard()

    def used_this_step(self) -> bool:
        return self.ctx is not None and self.reduction.used_step == self.ctx.step

    def reset_backward(self) -> None:
        self.codec.drop_secondary()
        self.reduction.reset_backward()

    # ---------------------------------------------------------------- accounting
    def tensor_bytes(self) -> dict:
        """Bytes held by this unit's persistent tensors (for tests and the benchmark); the model's
        pooled buffers are counted once, by `ShardedModule.sharded_tensor_bytes`."""
        nbytes = lambda t: 0 if t is None else t.untyped_storage().nbytes()
        return {
            "shard": nbytes(self.shard),
            "grad_shard": self.reduction.grad_bytes(),
            "unsharded": 0 if self.storage is None else self.storage.nbytes(),
            "accum": nbytes(self.reduction.accum),
            "secondary": nbytes(self.codec.secondary),
            "send": nbytes(self.codec.send),
        }
