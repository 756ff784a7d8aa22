"""One unit: the parameters gathered and reduced together (one `fully_shard` call).

Owns the fp32 shard buffer (the optimizer's parameters are views into it), the fp32 gradient
shard buffer (their `.grad` views), the unsharded storage that the modules compute with, and the
unit's part of the step: unshard, reshard, reduce gradients, finish the reduction.
See [Note: flat storage] in flat.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import collectives as C
from .api import MixedPrecisionPolicy, QuantizedCommPolicy, UnitState
from .flat import FlatEntry, FlatLayout, dequantize_into, packed_nbytes, quantize_into

if TYPE_CHECKING:
    from .context import ShardContext


class _Reduction(NamedTuple):
    """A unit's gradient reduction in flight (issued by reduce_grads, drained by finish_reduce)."""

    pending: C.Pending
    pooled_input: Optional[torch.Tensor]  # reduce-scatter input to give back to the pool
    direct: bool  # the output is the grad shard itself
    fresh: bool  # the sharded params had no .grad: assign views instead of accumulating
    pre_divided: bool  # 16-bit reduce: divided by dp before the sum
    out: Optional[torch.Tensor]  # pooled output buffer when not direct
    in_place: bool  # the input is the unit's gathered storage: reshard when done
    scratch: Optional[torch.Tensor]  # reduce-scatter receive scratch to give back

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

#
# [Note: gradients reuse the gathered storage]
# Once a parameter's gradient is complete (summed over all its uses), backward never reads that
# parameter again. So a leaf hook copies each gradient into the parameter's own slot of the
# unit's gathered storage (pre_accumulate), and when the unit's last gradient is in, that storage
# is the reduce-scatter input; it is released when the reduce-scatter finishes (at most
# MAX_IN_FLIGHT units wait, see state.py). No separate gradient buffer exists, the peak during
# backward is one unit lower than with one, and between steps the engine holds only shards.
# Units with frozen parameters (which later backward ops may still read) or a reduce dtype that
# differs from the param dtype use a pooled buffer instead ([Note: the gradient buffer pool]).


class ShardUnit:
    def __init__(
        self,
        module: nn.Module,
        entries: List[FlatEntry],
        layout: FlatLayout,
        shard_group: dist.ProcessGroup,
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
        self.ctx: Optional["ShardContext"] = None
        self.stats = C.CommStats()
        self.requires_grad_sync = True
        # units gathered ahead of this one's forward / backward when set explicitly; None = the
        # recorded forward order (set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)
        self.forward_prefetch: Optional[List["ShardUnit"]] = None
        self.backward_prefetch: Optional[List["ShardUnit"]] = None
        self.trainable = [e for e in entries if e.requires_grad]
        shard_device = torch.device("cpu") if offload else compute_device
        pin = offload and compute_device.type == "cuda"
        S = layout.shard_numel
        self.shard = torch.zeros(S, dtype=shard_dtype, device=shard_device, pin_memory=pin)
        self.grad_shard = torch.zeros(S, dtype=shard_dtype, device=shard_device, pin_memory=pin) if self.trainable else None
        self.sharded_params: List[nn.Parameter] = []
        self.full_params: List[torch.Tensor] = []
        self._accum: Optional[torch.Tensor] = None  # unsharded grads kept across no-sync micro-steps
        self._accum_valid = False
        self._grads_seen = 0
        self._reduce_issued = False
        self._written = [False] * len(entries)  # grad already written in place this backward
        self._pending: Optional[_Reduction] = None
        self._send: Optional[torch.Tensor] = None
        self._recv_packed: Optional[torch.Tensor] = None
        self._gather: Optional[C.Pending] = None
        self._gather_quantized = False
        self._hpz: Optional[tuple] = None  # (group, k, index) for hpZ, see [Note: hpZ secondary shards]
        self._secondary: Optional[torch.Tensor] = None
        self._secondary_valid = False
        self._build_full_storage()

    # ---------------------------------------------------------------- construction
    def _zero_copy(self) -> bool:
        return self.N == 1 and self.param_dtype == self.shard_dtype and not self.offload

    def _build_full_storage(self) -> None:
        L = self.layout
        if self._zero_copy():
            self.full_flat = self.shard
            self.storage = None
        else:
            self.full_flat = torch.empty(L.padded_total, dtype=self.param_dtype, device=self.compute_device)
            self.storage = self.full_flat.untyped_storage()
            self.storage.resize_(0)
        base = self.full_flat.untyped_storage()
        self.full_params = []
        for e in self.entries:
            t = torch.empty(0, dtype=self.param_dtype, device=self.compute_device)
            with torch.no_grad():
                t.set_(base, e.offset, e.shape, _contiguous_stride(e.shape))
            t.requires_grad_(e.requires_grad)
            self.full_params.append(t)

    def rebind_after_apply(self) -> None:
        """After `module.to(...)` / `to_empty(...)` / `.double()` replaced the sharded parameters'
        data: rebuild the shard buffers on the new device/dtype from the parameters' new values,
        make the parameters views into them again, and rebuild the unsharded storage.

        Call between steps only (no gather or reduction in flight).
        """
        assert self.state == UnitState.SHARDED and self._pending is None, (
            f"[rank {self.rank}] unit {self.name}: moved while {self.state.value}; move the model between steps"
        )
        params = [e.users[0][0]._parameters[e.users[0][1]] for e in self.entries]
        if not params:
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
        self.grad_shard = torch.zeros(S, dtype=dtype, device=shard_device, pin_memory=pin) if self.trainable else None
        with torch.no_grad():
            for i, (e, sp) in enumerate(zip(self.entries, params)):
                view = self.shard[self.layout.shard_slice(e)]
                view.copy_(sp.detach().reshape(-1))
                sp.data = view
                sp.grad = None
                for mod, name, _ in e.users:
                    mod._parameters[name] = sp
                self.sharded_params[i] = sp
        self._send = self._recv_packed = self._secondary = self._accum = None
        self._accum_valid = self._secondary_valid = False
        if getattr(self, "_q_send", None) is not None:
            self._q_send = self._q_recv = None
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
            self._gather = C.all_gather(self.full_flat, self._secondary, self._hpz[0], self.stats)
            self.set_state(UnitState.UNSHARDING)
            return
        qp = self.comm is not None and self.comm.params and self.N > 1
        self._gather_quantized = qp
        if qp:
            nb = packed_nbytes(L.shard_numel, self.comm.block_size)
            if self._send is None:
                self._send = torch.empty(nb, dtype=torch.uint8, device=self.compute_device)
                self._recv_packed = torch.empty(nb * self.N, dtype=torch.uint8, device=self.compute_device)
            quantize_into(self.shard, self._send, self.comm.block_size)
            self._gather = C.all_gather(self._recv_packed, self._send, self.shard_group, self.stats)
        else:
            src = self.shard
            if self.param_dtype != self.shard_dtype or self.shard.device != self.compute_device:
                if self._send is None:
                    self._send = torch.empty(L.shard_numel, dtype=self.param_dtype, device=self.compute_device)
                self._send.copy_(self.shard, non_blocking=True)
                src = self._send
            self._gather = C.all_gather(self.full_flat, src, self.shard_group, self.stats)
        self.set_state(UnitState.UNSHARDING)

    def wait_unshard(self) -> None:
        if self.state == UnitState.SHARDED:
            self.unshard()
        if self.state == UnitState.UNSHARDED:
            return
        C.wait(self._gather)
        self._gather = None
        if self._gather_quantized:
            S, nb = self.layout.shard_numel, packed_nbytes(self.layout.shard_numel, self.comm.block_size)
            for r in range(self.N):
                dequantize_into(self._recv_packed[r * nb:(r + 1) * nb], self.full_flat[r * S:(r + 1) * S], self.comm.block_size)
        self.set_state(UnitState.UNSHARDED)
        self._expose()

    def _expose(self) -> None:
        # The modules read the full parameter through the instance __dict__, which Python consults
        # before nn.Module.__getattr__ (and so before _parameters, which keeps the sharded piece
        # that named_parameters() and the optimizer see).
        for e, full in zip(self.entries, self.full_params):
            if e.tp is not None:
                # [Note: tensor parallel composition] the engine shards the TP-local tensor over
                # the dp mesh; the module gets back the full-over-dp, still TP-sharded DTensor, made
                # fresh each time with the differentiable from_local, so gradients arrive as local
                # tensors on `full` and take the same reduce-scatter path as plain parameters.
                full = DTensor.from_local(full, e.tp.mesh, e.tp.placements, run_check=False, shape=e.tp.shape, stride=e.tp.stride)
            for mod, attr, _ in e.users:
                mod.__dict__[attr] = full

    def _hide(self) -> None:
        for e in self.entries:
            for mod, attr, _ in e.users:
                mod.__dict__.pop(attr, None)

    # [Note: hpZ secondary shards]
    # With reshard_after_forward=k (1 < k < N), resharding after forward keeps a secondary shard:
    # this rank's 1/k of the gathered flat buffer (N S / k elements), so the backward re-gather is an
    # all-gather over k ranks (intra-node in ZeRO++) instead of N. The secondary shard is dropped
    # when backward ends; the next forward gathers from the primary (updated) shards again.
    def set_secondary(self, group: dist.ProcessGroup, k: int, index: int) -> None:
        self._hpz = (group, k, index)

    def reshard_after_forward_step(self) -> None:
        if self._hpz is None or self.state != UnitState.UNSHARDED:
            self.reshard()
            return
        group, k, idx = self._hpz
        M = self.layout.padded_total // k
        if self._secondary is None:
            self._secondary = torch.empty(M, dtype=self.param_dtype, device=self.compute_device)
        elif self._secondary.untyped_storage().nbytes() == 0:
            self._secondary.untyped_storage().resize_(M * self._secondary.element_size())
        self._secondary.copy_(self.full_flat[idx * M:(idx + 1) * M])
        self.reshard()
        self._secondary_valid = True

    def drop_secondary(self) -> None:
        self._secondary_valid = False
        if self._secondary is not None:
            self._secondary.untyped_storage().resize_(0)

    def reshard(self) -> None:
        if self.state == UnitState.UNSHARDING:
            self.wait_unshard()
        if self.state == UnitState.SHARDED:
            return
        self._hide()
        if self.storage is not None:
            self.storage.resize_(0)
        self.set_state(UnitState.SHARDED)

    # ---------------------------------------------------------------- gradients
    def _in_place_this_backward(self) -> bool:
        return self.requires_grad_sync and not self._accum_valid and self._can_reduce_in_place()

    def pre_accumulate(self, idx: int, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """Leaf hook, before autograd stores the full parameter's gradient.

        With in-place reduction (see [Note: gradients reuse the gathered storage]) the gradient is
        written straight into the parameter's own slot of the gathered storage, and that slot is
        handed to autograd to store: one copy, which also fixes the layout of transposed weight
        gradients (which autograd would otherwise clone into the parameter's layout first).
        """
        if not self._in_place_this_backward() or self._written[idx]:
            return None
        e = self.entries[idx]
        dst = self.full_flat[e.offset:e.offset + e.numel].view(e.shape)
        with torch.no_grad():
            dst.copy_(grad)
        self._written[idx] = True
        return dst

    def on_grad(self) -> None:
        """Post-accumulate-grad of one trainable full parameter; the last one reduces the unit."""
        self._grads_seen += 1
        if self._grads_seen == len(self.trainable):
            self.reduce_grads()

    def reduce_grads(self) -> None:
        """Put the unit's full grads in one flat buffer and issue the reduce-scatter (async)."""
        if self._reduce_issued or not self.trainable:
            return
        self._reduce_issued = True
        L = self.layout
        if not self.requires_grad_sync:
            if self._accum is None:
                self._accum = torch.zeros(L.padded_total, dtype=self.reduce_dtype, device=self.compute_device)
            self._write_grads(self._accum, accumulate=self._accum_valid)
            self._accum_valid = True
            self.reshard()
            return
        in_place = False
        if self._accum_valid:
            self._write_grads(self._accum, accumulate=True)
            buf, pooled = self._accum, False
        elif self._can_reduce_in_place():
            buf, pooled, in_place = self.full_flat, False, True
            self._write_grads(buf, accumulate=False)
        else:
            buf = self.ctx.acquire_grad_buffer(L.padded_total, self.reduce_dtype, self.compute_device)
            self._write_grads(buf, accumulate=False)
            pooled = True
        low_precision = self.reduce_dtype in (torch.float16, torch.bfloat16)
        if low_precision:
            buf.div_(self.dp)  # pre-divide so a 16-bit sum cannot overflow
        fresh = all(p.grad is None for p in self._trainable_sharded())
        direct = fresh and buf.dtype == self.shard_dtype and self.grad_shard.device == buf.device
        quant = self.comm is not None and self.comm.grads and self.N > 1
        scratch = None
        if quant:
            out = self.ctx.acquire_grad_buffer(L.shard_numel, torch.float32, self.compute_device, tag="q")
            pending = self._issue_quantized_reduce(buf, out)
            direct = False
        else:
            out = self.grad_shard if direct else self.ctx.acquire_grad_buffer(
                L.shard_numel, self.reduce_dtype, self.compute_device, tag="out"
            )
            k = C.reduce_scatter_scratch_numel(self.shard_group, L.shard_numel)
            scratch = self.ctx.acquire_grad_buffer(k, buf.dtype, self.compute_device, tag="rs") if k else None
            pending = C.reduce_scatter(out, buf, self.shard_group, self.stats, scratch)
        self._pending = _Reduction(pending, buf if pooled else None, direct, fresh, low_precision, None if direct else out, in_place, scratch)
        if in_place:
            self._hide()  # the storage now holds gradients; resharded when the reduction finishes
        else:
            self.reshard()
        self.ctx.add_pending(self)

    def _can_reduce_in_place(self) -> bool:
        """All params trainable and same dtype: once the last grad arrived, backward no longer reads
        the gathered params, so the gathered storage can be the reduce-scatter input."""
        return (
            self.storage is not None
            and self.reduce_dtype == self.param_dtype
            and len(self.trainable) == len(self.entries)
            and self.state == UnitState.UNSHARDED
        )

    def _write_grads(self, buf: torch.Tensor, accumulate: bool) -> None:
        L = self.layout
        with torch.no_grad():
            for i, (e, full) in enumerate(zip(self.entries, self.full_params)):
                g = full.grad if e.requires_grad else None
                if self._written[i]:  # already in place (pre_accumulate)
                    full.grad = None
                    continue
                dst = buf[e.offset:e.offset + e.numel]
                if g is None:
                    if not accumulate:
                        dst.zero_()
                else:
                    dst.add_(g.view(-1)) if accumulate else dst.copy_(g.reshape(-1))
                    full.grad = None
            if not accumulate and L.padded_total > L.total:
                buf[L.total:].zero_()

    def _issue_quantized_reduce(self, buf: torch.Tensor, out: torch.Tensor) -> C.Pending:
        """qgZ: quantize all N chunks, all-to-all them, sum the dequantized chunks in finish_reduce."""
        b = self.comm.block_size
        nb = packed_nbytes(self.layout.shard_numel, b)
        if getattr(self, "_q_send", None) is None:
            self._q_send = torch.empty(nb * self.N, dtype=torch.uint8, device=self.compute_device)
            self._q_recv = torch.empty(nb * self.N, dtype=torch.uint8, device=self.compute_device)
        S = self.layout.shard_numel
        for r in range(self.N):
            quantize_into(buf[r * S:(r + 1) * S], self._q_send[r * nb:(r + 1) * nb], b)
        return C.all_to_all(self._q_recv, self._q_send, self.shard_group, self.stats)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter, all-reduce over replicas, average, expose `.grad` views."""
        if self._pending is None:
            return
        pending, buf, direct, fresh, pre_divided, out, in_place, scratch = self._pending
        self._pending = None
        C.wait(pending)
        if in_place:
            self.reshard()
        if scratch is not None:
            self.ctx.release_grad_buffer(scratch)
        if self.comm is not None and self.comm.grads and self.N > 1:
            b, S = self.comm.block_size, self.layout.shard_numel
            nb = packed_nbytes(S, b)
            tmp = torch.empty(S, dtype=torch.float32, device=out.device)
            for r in range(self.N):
                dequantize_into(self._q_recv[r * nb:(r + 1) * nb], tmp, b)
                out.copy_(tmp) if r == 0 else out.add_(tmp)
        if buf is not None:
            self.ctx.release_grad_buffer(buf)
        if self._accum_valid:
            self._accum_valid = False  # the accumulated grads went into this reduction
        reduced = self.grad_shard if direct else out
        if self.R > 1:
            C.wait(C.all_reduce(reduced, self.replicate_group, self.stats))
        if not pre_divided:
            reduced.div_(self.dp)
        params = self._trainable_sharded()
        with torch.no_grad():
            if fresh:
                if not direct:
                    self.grad_shard.copy_(reduced, non_blocking=True)
                for p, e in zip(params, self.trainable):
                    p.grad = self.grad_shard[self.layout.shard_slice(e)]
            else:
                for p, e in zip(params, self.trainable):
                    piece = reduced[self.layout.shard_slice(e)].to(p.dtype)
                    if p.grad is None:
                        p.grad = piece.clone()
                    else:
                        p.grad.add_(piece)
        if out is not None and out is not self.grad_shard:
            self.ctx.release_grad_buffer(out)
        # Autograd never accumulates into the sharded parameters (the modules compute with the
        # unsharded ones), so their post-accumulate-grad hooks run here, once the reduced gradient
        # is in place (as in FSDP2): e.g. an optimizer stepped per parameter inside backward.
        for p in params:
            for hook in tuple((getattr(p, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(p)

    def _trainable_sharded(self) -> List[nn.Parameter]:
        return [p for p, e in zip(self.sharded_params, self.entries) if e.requires_grad]

    def reset_backward(self) -> None:
        self.drop_secondary()
        self._grads_seen = 0
        self._reduce_issued = False
        self._written = [False] * len(self.entries)

    # ---------------------------------------------------------------- accounting
    def tensor_bytes(self) -> dict:
        """Bytes held by this unit's persistent tensors (for tests and the benchmark)."""
        nbytes = lambda t: 0 if t is None else t.untyped_storage().nbytes()
        return {
            "shard": nbytes(self.shard),
            "grad_shard": nbytes(self.grad_shard),
            "unsharded": 0 if self.storage is None else self.storage.nbytes(),
            "accum": nbytes(self._accum),
            "secondary": nbytes(self._secondary),
        }


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
