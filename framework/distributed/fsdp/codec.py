"""How a unit's parameters travel in its all-gather: the codec a `ShardUnit` (unit.py) holds as
`unit.codec`. One of plain (the shard as it is, or cast to the param dtype / moved to the compute
device into a send buffer), int8 blocks (ZeRO++ qwZ) or float8 per weight ([Note: float8
all-gather] in zeropp.py), plus hpZ's secondary shard ([Note: hpZ secondary shards]) when
`reshard_after_forward=<int>` asks for one. It owns what only the encoding needs (the send
buffer, the float8 plan and scales, the secondary shard) and reads the unit's storage; the unit
owns the gathered storage and its state machine.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import collectives as C
from .api import TrainingPhase
from .zeropp import FLOAT8, FLOAT8_MAX, dequantize_into, float8_plan, float8_scale, packed_nbytes, quantize_into


class GatherCodec:
    """The gather encoding of one unit, held by it as `unit.codec`."""

    def __init__(self, unit) -> None:
        self.unit = unit
        # The shard cast to param_dtype / moved to the compute device, for one gather: freed when the
        # gather is waited on (FSDP2 allocates its all-gather input per call too). Kept between
        # gathers it would hold param_dtype bytes for every parameter of this rank's shards.
        self.send: Optional[torch.Tensor] = None
        self.quantized = False  # the gather in flight is packed (int8 / float8)
        self.hpz: Optional[tuple] = None  # (group, k, index) for hpZ, see [Note: hpZ secondary shards]
        self.secondary: Optional[torch.Tensor] = None
        self.secondary_valid = False
        self.plan_float8()

    def plan_float8(self) -> None:
        """Which pieces go as float8 ([Note: float8 all-gather] in zeropp.py), and the per-weight
        scales of the last forward gather; None when the unit has no float8 weight."""
        u = self.unit
        self.f8, self.f8_scale = None, None
        comm = u.comm
        if comm is not None and comm.dtype == "float8":
            is_f8 = [e.tp is None and comm.float8_weight(e.users[0][0], e.users[0][1]) for e in u.entries]
            if any(is_f8):
                esize = torch.empty(0, dtype=u.param_dtype).element_size()
                self.f8 = float8_plan(u.layout, is_f8, esize)

    def reset(self) -> None:
        """The unit moved (device or dtype): drop the buffers and plan again."""
        self.send = self.secondary = None
        self.secondary_valid = False
        self.plan_float8()

    # ---------------------------------------------------------------- the gather
    def issue(self) -> C.Pending:
        """Issue the all-gather into the unit's (resized) gathered storage."""
        u = self.unit
        L = u.layout
        if self.secondary_valid:  # hpZ: backward gathers from the secondary shards, within k ranks
            self.quantized = False
            return C.all_gather(u.full_flat, self.secondary, u.transports()[2], u.stats, u.name)
        qp = u.comm is not None and u.comm.params and u.N > 1
        if qp and u.comm.dtype == "float8":
            qp = self.f8 is not None  # a unit without float8 weights gathers in the param dtype
        self.quantized = qp
        if qp:
            # [Note: int8 buffers live inside the unit's own storage] the packed chunks are received
            # into the tail of the storage just resized for the full parameters (1 + 4/block bytes
            # per value fit in the 2 or 4 of the param dtype), this rank's own chunk is quantized
            # straight into its slot, and `finish` dequantizes front to back, each chunk ending
            # before the next packed one starts. No int8 buffer outlives the gather.
            packed = self._packed_tail()
            nb = self._packed_chunk_nbytes()
            own = packed[L.rank * nb : (L.rank + 1) * nb]
            self._quantize_own(own)
            return C.all_gather(packed, own, u.transports()[0], u.stats, u.name)
        src = u.shard
        if u.param_dtype != u.shard_dtype or u.shard.device != u.compute_device:
            self.send = torch.empty(L.shard_numel, dtype=u.param_dtype, device=u.compute_device)
            self.send.copy_(u.shard, non_blocking=True)
            src = self.send
        return C.all_gather(u.full_flat, src, u.transports()[0], u.stats, u.name)

    def finish(self) -> None:
        """The gather was waited on: free the send buffer, unpack what came packed."""
        self.send = None
        if self.quantized:
            self._dequantize_gathered()

    def _packed_chunk_nbytes(self) -> int:
        if self.f8 is not None:
            return self.f8.nbytes
        return packed_nbytes(self.unit.layout.shard_numel, self.unit.comm.block_size)

    def _packed_tail(self) -> torch.Tensor:
        """The last N x packed-shard bytes of the (resized) unsharded storage, as uint8."""
        nb = self._packed_chunk_nbytes() * self.unit.N
        total = self.unit.storage.nbytes()
        t = torch.empty(0, dtype=torch.uint8, device=self.unit.compute_device)
        return t.set_(self.unit.storage, total - nb, (nb,), (1,))

    def _quantize_own(self, own: torch.Tensor) -> None:
        """Pack this rank's shard into its slot `own` of the gather (int8 blocks or float8)."""
        if self.f8 is None:
            quantize_into(self.unit.shard, own, self.unit.comm.block_size)
            return
        self._float8_scales()
        base, dt, esize = self.unit.layout.shard_start, self.unit.param_dtype, self.unit.full_flat.element_size()
        with record_function("fsdp::float8_cast"):
            for a, b, k, pos in self.f8.pieces[self.unit.layout.rank]:
                x = self.unit.shard[a - base : b - base]
                if k >= 0:
                    q = x.float() * self.f8_scale[k]  # never in place: x is the fp32 master
                    q = q.clamp_(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
                    own[pos : pos + b - a].copy_(q.view(torch.uint8))
                else:
                    own[pos : pos + (b - a) * esize].view(dt).copy_(x)

    def _float8_scales(self) -> None:
        """One scale per float8 weight from its absmax over every shard; see [Note: float8 all-gather]."""
        phase = self.unit.ctx.phase if self.unit.ctx is not None else TrainingPhase.IDLE
        if self.f8_scale is not None and phase in (TrainingPhase.PRE_BACKWARD, TrainingPhase.POST_BACKWARD):
            return  # backward's re-gather: the weights are the forward's
        amax = torch.zeros(len(self.f8.weights), dtype=torch.float32, device=self.unit.compute_device)
        base = self.unit.layout.shard_start
        for a, b, k, _ in self.f8.pieces[self.unit.layout.rank]:
            if k >= 0:
                amax[k] = self.unit.shard[a - base : b - base].abs().max()  # one piece per weight and rank
        C.wait(
            C.all_reduce(amax, self.unit.shard_group, self.unit.stats, f"{self.unit.name}.amax", op=dist.ReduceOp.MAX)
        )
        self.f8_scale = float8_scale(amax)

    def _dequantize_gathered(self) -> None:
        """See [Note: int8 buffers live inside the unit's own storage] and [Note: float8 all-gather]."""
        S = self.unit.layout.shard_numel
        nb = self._packed_chunk_nbytes()
        packed = self._packed_tail()
        start = packed.storage_offset()  # byte offset of chunk 0 in the storage
        esize = self.unit.full_flat.element_size()
        with record_function("fsdp::dequantize"):
            for r in range(self.unit.N):
                src = packed[r * nb : (r + 1) * nb]
                if esize * (r + 1) * S > start + r * nb:  # would overwrite its own packed chunk:
                    src = src.clone()  # a transient copy of the packed chunk (1/4 of an fp32 shard)
                if self.f8 is None:
                    dequantize_into(src, self.unit.full_flat[r * S : (r + 1) * S], self.unit.comm.block_size)
                    continue
                for a, b, k, pos in self.f8.pieces[r]:
                    if k >= 0:
                        vals = src[pos : pos + b - a].view(FLOAT8).float().div_(self.f8_scale[k])
                    else:
                        vals = src[pos : pos + (b - a) * esize].view(self.unit.param_dtype)
                    self.unit.full_flat[a:b].copy_(vals)

    # [Note: hpZ secondary shards]
    # With reshard_after_forward=k (1 < k < N), resharding after forward keeps a secondary shard:
    # this rank's 1/k of the gathered flat buffer (N S / k elements), so the backward re-gather is an
    # all-gather over k ranks (intra-node in ZeRO++) instead of N. The secondary shard is dropped
    # when backward ends; the next forward gathers from the primary (updated) shards again.
    def set_secondary(self, group: dist.ProcessGroup, k: int, index: int) -> None:
        self.hpz = (group, k, index)

    def keep_secondary(self) -> None:
        """Before the unit reshards after forward, gathered: keep this rank's secondary shard
        (nothing without hpZ)."""
        if self.hpz is None:
            return
        group, k, idx = self.hpz
        M = self.unit.layout.padded_total // k
        if self.secondary is None:
            self.secondary = torch.empty(M, dtype=self.unit.param_dtype, device=self.unit.compute_device)
        elif self.secondary.untyped_storage().nbytes() == 0:
            self.secondary.untyped_storage().resize_(M * self.secondary.element_size())
        self.secondary.copy_(self.unit.full_flat[idx * M : (idx + 1) * M])
        self.secondary_valid = True

    def drop_secondary(self) -> None:
        self.secondary_valid = False
        if self.secondary is not None:
            self.secondary.untyped_storage().resize_(0)
