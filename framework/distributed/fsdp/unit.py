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
from .flat import FlatEntry, FlatLayout, contiguous_stride
from .reduce import GradReduction, _Reduction
from .transport import Transport
from .views import PieceSpec, ShardPiece
from .zeropp import ZeroPlusPlus, float8_plan, packed_nbytes

# [Note: records of sharded parameters]
# What the engine knows about a sharded parameter (its unit, its entry) is part of the parameter:
# a `ShardPiece` carries its `piece_spec` (views.py, [Note: pieces that describe themselves]), and
# every elementwise result of it (`.to()`, `to_empty()`'s `empty_like`, `zeros_like`) carries it
# on, so `module.to()` and `torch.utils.swap_tensors` keep it with no table to update. Only the
# original (pre-sharding) parameters are recorded, weakly, to refuse sharding one twice.
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


class ShardUnit(GradReduction, ZeroPlusPlus):
    """One `fully_shard` call's parameters: storage, state machine and gather here; backward's
    reduction in reduce.py (`GradReduction`), ZeRO++ in zeropp.py (`ZeroPlusPlus`)."""

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
        self.ctx: Optional[UnitContext] = None
        self.stats = C.CommStats()
        self.requires_grad_sync = True
        # FSDP2's per-module settings (sharded_module.py): the all-reduce over replicas (hybrid;
        # False keeps the reduce-scattered gradient as a partial sum, `_partial`), the factor the
        # summed gradients are divided by (None: the data-parallel size), freeing the gathered
        # parameters after backward, whether the user set reshard_after_forward (then the root
        # keeps it), and a forward method running (register_fsdp_forward_method)
        self.requires_all_reduce = True
        self._partial: Optional[torch.Tensor] = None
        self.divide_factor: Optional[float] = None
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
        # outputs) or its own gradient arrived (`_reached`, entry indices, kept until a synced
        # reduction hands the gradients over): a member that did not run, or whose outputs this
        # backward did not reach, leaves its parameters' `.grad` as it was (None, as FSDP2 does)
        # instead of adding zeros. Which members a backward reaches must be the same on every rank
        # (as FSDP2 requires of the parameters that get gradients).
        self.members: Optional[List[nn.Module]] = None
        self.members_run: set = set()
        self._reached: set = set()
        self.standalone = False  # its last forward ran outside the root's: no implicit prefetch (hooks.py)
        # units gathered ahead of this one's forward / backward when set explicitly; None = the
        # recorded forward order (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)
        self.forward_prefetch: Optional[List["ShardUnit"]] = None
        self.backward_prefetch: Optional[List["ShardUnit"]] = None
        self.trainable = [e for e in entries if e.requires_grad]
        self.has_frozen = len(self.trainable) < len(entries)
        shard_device = torch.device("cpu") if offload else compute_device
        pin = offload and compute_device.type == "cuda"
        S = layout.shard_numel
        self.shard = torch.zeros(S, dtype=shard_dtype, device=shard_device, pin_memory=pin)
        # [Note: gradient shards live from backward to zero_grad]
        # The fp32 gradient shard is allocated when a backward's reduction needs it and handed
        # over to the sharded parameters' `.grad` views; the unit keeps no reference between
        # steps, so `zero_grad(set_to_none=True)` frees it (as FSDP2's per-parameter gradients
        # are freed) and forward and the early backward run without it. `grad_shard` is set
        # only while a reduction is in flight.
        self.grad_shard: Optional[torch.Tensor] = None
        self.sharded_params: List[nn.Parameter] = []
        self.full_params: List[torch.Tensor] = []
        self._accum: Optional[torch.Tensor] = None  # unsharded grads kept across no-sync micro-steps
        self._accum_valid = False
        self._grads_seen = 0
        self._reduce_issued = False
        self._written = [False] * len(entries)  # grad already written in place this backward
        self._pending: Optional[_Reduction] = None
        # The shard cast to param_dtype / moved to the compute device, for one gather: freed when the
        # gather is waited on (FSDP2 allocates its all-gather input per call too). Kept between
        # gathers it would hold param_dtype bytes for every parameter of this rank's shards.
        self._send: Optional[torch.Tensor] = None
        self._gather: Optional[C.Pending] = None
        # Per step (see [Note: reductions in a fixed order on their own group], and [Note: frozen
        # parameters reshard after the unit's whole backward]):
        self._used_step = -1  # ctx.step of this unit's last forward under grad mode
        self._ready = False  # every trainable gradient of this backward has arrived
        self.bwd_reached = False  # this backward reached the unit (its outputs, or a gradient)
        self._fwd_uses = 0  # forward calls of this step whose inputs carry the post-backward hook
        self._bwd_done = 0  # of those, how many have finished their backward
        self._gather_quantized = False
        self._hpz: Optional[tuple] = None  # (group, k, index) for hpZ, see [Note: hpZ secondary shards]
        self._secondary: Optional[torch.Tensor] = None
        self._secondary_valid = False
        self._transports: Optional[Tuple[Transport, Transport, Optional[Transport]]] = None
        # float8 gather ([Note: float8 all-gather] in zeropp.py): which pieces go as float8, and the
        # per-weight scales of the last forward gather; None when the unit has no float8 weight
        self._f8 = None
        self._f8_scale: Optional[torch.Tensor] = None
        self._plan_float8()
        self._build_full_storage()

    def _plan_float8(self) -> None:
        self._f8, self._f8_scale = None, None
        comm = self.comm
        if comm is not None and comm.dtype == "float8":
            is_f8 = [e.tp is None and comm.float8_weight(e.users[0][0], e.users[0][1]) for e in self.entries]
            if any(is_f8):
                esize = torch.empty(0, dtype=self.param_dtype).element_size()
                self._f8 = float8_plan(self.layout, is_f8, esize)

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
            secondary = C.transport_for(self._hpz[0], dev) if self._hpz is not None else None
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
        splits the parameter."""
        e = self.entries[index]
        tp_sharded = e.tp is not None and any(not pl.is_replicate() for pl in e.tp.placements)
        return self.R * (1 if tp_sharded else self.tp_size)

    def rebind_after_apply(self, fn) -> None:
        """After `module.to(...)` / `to_empty(...)` / `.double()` (`fn`, as passed to `_apply`)
        replaced the sharded parameters' data: rebuild the shard buffers on the new device/dtype
        from the parameters' new values, make the parameters views into them again, record the
        (possibly new) Parameter objects, and rebuild the unsharded storage.

        Call between steps only (no gather or reduction in flight).
        """
        assert self.state == UnitState.SHARDED and self._pending is None, (
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
        self.grad_shard = None
        with torch.no_grad():
            for i, (e, sp) in enumerate(zip(self.entries, params)):
                view = self.shard[self.layout.shard_slice(e)]
                view.copy_(sp.detach().reshape(-1))
                sp.data = view
                sp.grad = None
                for mod, name, _ in e.users:
                    mod._parameters[name] = sp
                self.set_sharded_param(i, sp)
        self._send = self._secondary = self._accum = None
        self._accum_valid = self._secondary_valid = False
        self._transports = None  # chosen again for the new device on first use
        self._plan_float8()  # the param dtype's size places the packed pieces
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
        if self._secondary_valid:  # hpZ: backward gathers from the secondary shards, within k ranks
            self._gather_quantized = False
            self._gather = C.all_gather(self.full_flat, self._secondary, self.transports()[2], self.stats, self.name)
            self.set_state(UnitState.UNSHARDING)
            return
        qp = self.comm is not None and self.comm.params and self.N > 1
        if qp and self.comm.dtype == "float8":
            qp = self._f8 is not None  # a unit without float8 weights gathers in the param dtype
        self._gather_quantized = qp
        if qp:
            # [Note: int8 buffers live inside the unit's own storage] the packed chunks are received
            # into the tail of the storage just resized for the full parameters (1 + 4/block bytes
            # per value fit in the 2 or 4 of the param dtype), this rank's own chunk is quantized
            # straight into its slot, and wait_unshard dequantizes front to back, each chunk ending
            # before the next packed one starts. No int8 buffer outlives the gather.
            packed = self._packed_tail()
            nb = self._packed_chunk_nbytes()
            own = packed[L.rank * nb : (L.rank + 1) * nb]
            self._quantize_own(own)
            self._gather = C.all_gather(packed, own, self.transports()[0], self.stats, self.name)
        else:
            src = self.shard
            if self.param_dtype != self.shard_dtype or self.shard.device != self.compute_device:
                self._send = torch.empty(L.shard_numel, dtype=self.param_dtype, device=self.compute_device)
                self._send.copy_(self.shard, non_blocking=True)
                src = self._send
            self._gather = C.all_gather(self.full_flat, src, self.transports()[0], self.stats, self.name)
        self.set_state(UnitState.UNSHARDING)

    def wait_unshard(self) -> None:
        if self.state == UnitState.SHARDED:
            self.unshard()
        if self.state == UnitState.UNSHARDED:
            return
        C.wait(self._gather)
        self._gather = self._send = None
        if self._gather_quantized:
            self._dequantize_gathered()
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

    def reshard_after_backward_step(self) -> None:
        """Backward is done with the gathered parameters: free them, unless
        `set_reshard_after_backward(False)` keeps them for the next forward."""
        if self.reshard_after_backward:
            self.reshard()

    def used_this_step(self) -> bool:
        return self.ctx is not None and self._used_step == self.ctx.step

    def reset_backward(self) -> None:
        self.drop_secondary()
        self.bwd_reached = False
        self._grads_seen = 0
        self._reduce_issued = False
        self._ready = False
        self._bwd_done = 0
        self._written = [False] * len(self.entries)

    # ---------------------------------------------------------------- accounting
    def tensor_bytes(self) -> dict:
        """Bytes held by this unit's persistent tensors (for tests and the benchmark); the model's
        pooled buffers are counted once, by `ShardedModule.sharded_tensor_bytes`."""
        nbytes = lambda t: 0 if t is None else t.untyped_storage().nbytes()
        return {
            "shard": nbytes(self.shard),
            "grad_shard": self.grad_bytes(),
            "unsharded": 0 if self.storage is None else self.storage.nbytes(),
            "accum": nbytes(self._accum),
            "secondary": nbytes(self._secondary),
            "send": nbytes(self._send),
        }
