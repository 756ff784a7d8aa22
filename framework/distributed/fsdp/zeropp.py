"""Low-precision communication on the engine: ZeRO++ int8 (qwZ, qgZ) with its block-quantization
kernels, the float8 gather of float8 training, and hpZ secondary shards.

`ZeroPlusPlus` is the part of `ShardUnit` (unit.py) for these: the quantized gather's packing and
unpacking inside the unit's own storage (int8 blocks or float8 per parameter, one design), the
quantized gradient all-to-all, and the secondary shard kept after forward. See
`QuantizedCommPolicy` in api.py and `reshard_after_forward=<int>` in fully_shard.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import collectives as C
from .api import TrainingPhase, UnitState
from .flat import FlatLayout

# ---- int8 block quantization (ZeRO++ qwZ/qgZ) -------------------------------------------------
# A packed block-quantized buffer of n values (n a multiple of the block) is a uint8 tensor of
# n + 4 n / block bytes: n int8 values, then n / block fp32 scales (absmax / 127).


def packed_nbytes(n: int, block: int) -> int:
    return n + 4 * (n // block)


# Quantization works through a unit in pieces of _PIECE blocks, so its temporaries (fp32 copies,
# the int8 values) stay a few MB whatever the unit's size; see also [Note: int8 buffers live
# inside the unit's own storage] in unit.py, which relies on the write order below.
_PIECE = 4096


def quantize_into(x: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Quantize flat `x` (n values) into the packed uint8 buffer `out`.

    Piece by piece, front to back: each piece of `x` is read whole before its int8 values are
    written, and the scales are written last, so `out` may start at or before `x` in the same
    memory (packing in place) as long as it never runs ahead of the part of `x` not yet read.
    """
    n = x.numel()
    step = block * _PIECE
    scales = torch.empty(n // block, dtype=torch.float32, device=x.device)
    for a in range(0, n, step):
        xb = x[a : a + step].reshape(-1, block).float()
        scale = scales[a // block : a // block + xb.shape[0]]
        torch.amax(xb.abs(), dim=1, out=scale)
        scale.clamp_min_(1e-30).div_(127.0)
        q = torch.round(xb / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        out[a : a + q.numel()].copy_(q.view(-1).view(torch.uint8))
    out[n:].copy_(scales.view(torch.uint8))


def dequantize_into(packed: torch.Tensor, out: torch.Tensor, block: int, accumulate: bool = False) -> None:
    """Inverse of `quantize_into`, writing (or with `accumulate`, adding) n values into `out`
    (any float dtype), piece by piece. `packed` must not overlap `out`."""
    n = out.numel()
    step = block * _PIECE
    scales = packed[n:].view(torch.float32)
    for a in range(0, n, step):
        q = packed[a : min(a + step, n)].view(torch.int8).view(-1, block)
        vals = q.float().mul_(scales[a // block : a // block + q.shape[0], None])
        dst = out[a : a + vals.numel()].view(-1, block)
        dst.add_(vals) if accumulate else dst.copy_(vals)


# ---- float8 gather (float8 training) -----------------------------------------------------------
# [Note: float8 all-gather]
# Under float8 training the linears cast their weight to float8 e4m3 with one scale per tensor
# (448 / absmax) before every matmul. Gathering that weight in the param dtype moves 2-4 bytes per
# element only for the linear to throw most of them away, so the unit's shard is cast before the
# gather instead: one byte per element of every float8 weight, the unit's other parameters (norms,
# biases) in the param dtype. Each rank holds only a piece of a weight, so the per-tensor absmax
# is agreed first: each rank's absmax per float8 weight, one MAX all-reduce of that small vector
# per unit and forward (backward's re-gather reuses the forward's scales: the weights have not
# changed in between). Receivers multiply back; the linear's own cast then finds the same absmax
# (to float rounding far below half a float8 step) and reproduces exactly the gathered float8
# values, so the gather adds no error of its own: float8 training with this gather equals float8
# training with a full-precision gather (tested). The fp32 master shard and the gradient
# reductions are untouched.
# Packed chunk of rank r (its slice of the flat buffer, padding not sent): the float8 bytes of its
# float8 pieces, then, aligned to the param dtype, its other pieces; every chunk padded to the
# largest (P bytes), since all-gather moves equal chunks. P <= S x element size, so the chunks fit
# in the tail of the unit's storage exactly as int8 ones do ([Note: int8 buffers live inside the
# unit's own storage] in unit.py) and are unpacked front to back the same way.
FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass(frozen=True)
class Float8Plan:
    weights: List[int]  # entry indices gathered as float8, in scale order
    # per rank: (flat lo, flat hi, scale index or -1 for the param dtype, byte position in the chunk)
    pieces: List[List[Tuple[int, int, int, int]]]
    nbytes: int  # P: bytes of every rank's packed chunk


def float8_plan(layout: FlatLayout, is_float8: List[bool], esize: int) -> Float8Plan:
    weights = [i for i, f in enumerate(is_float8) if f]
    slot = {i: k for k, i in enumerate(weights)}
    S, pieces, P = layout.shard_numel, [], esize
    for r in range(layout.world):
        lo, hi = r * S, (r + 1) * S
        mine = []
        for i, e in enumerate(layout.entries):
            a, b = max(e.offset, lo), min(e.offset + e.numel, hi)
            if a < b:
                mine.append((a, b, slot.get(i, -1)))
        n8 = sum(b - a for a, b, k in mine if k >= 0)
        pos8, posh, out = 0, -(-n8 // esize) * esize, []
        for a, b, k in mine:
            if k >= 0:
                out.append((a, b, k, pos8))
                pos8 += b - a
            else:
                out.append((a, b, -1, posh))
                posh += (b - a) * esize
        pieces.append(out)
        P = max(P, posh)
    return Float8Plan(weights, pieces, -(-P // esize) * esize)


def float8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor float8 multiplier of torchao's dynamic tensor-wise scaling: 448 / absmax."""
    return (FLOAT8_MAX / amax.double().clamp(min=1e-12)).float()


class ZeroPlusPlus:
    """Quantized gathers and reductions, and hpZ secondary shards (mixed into `ShardUnit`)."""

    def _packed_chunk_nbytes(self) -> int:
        if self._f8 is not None:
            return self._f8.nbytes
        return packed_nbytes(self.layout.shard_numel, self.comm.block_size)

    def _packed_tail(self) -> torch.Tensor:
        """The last N x packed-shard bytes of the (resized) unsharded storage, as uint8."""
        nb = self._packed_chunk_nbytes() * self.N
        total = self.storage.nbytes()
        t = torch.empty(0, dtype=torch.uint8, device=self.compute_device)
        return t.set_(self.storage, total - nb, (nb,), (1,))

    def _quantize_own(self, own: torch.Tensor) -> None:
        """Pack this rank's shard into its slot `own` of the gather (int8 blocks or float8)."""
        if self._f8 is None:
            quantize_into(self.shard, own, self.comm.block_size)
            return
        self._float8_scales()
        base, dt, esize = self.layout.shard_start, self.param_dtype, self.full_flat.element_size()
        with record_function("fsdp::float8_cast"):
            for a, b, k, pos in self._f8.pieces[self.layout.rank]:
                x = self.shard[a - base : b - base]
                if k >= 0:
                    q = x.float() * self._f8_scale[k]  # never in place: x is the fp32 master
                    q = q.clamp_(-FLOAT8_MAX, FLOAT8_MAX).to(FLOAT8)
                    own[pos : pos + b - a].copy_(q.view(torch.uint8))
                else:
                    own[pos : pos + (b - a) * esize].view(dt).copy_(x)

    def _float8_scales(self) -> None:
        """One scale per float8 weight from its absmax over every shard; see [Note: float8 all-gather]."""
        phase = self.ctx.phase if self.ctx is not None else TrainingPhase.IDLE
        if self._f8_scale is not None and phase in (TrainingPhase.PRE_BACKWARD, TrainingPhase.POST_BACKWARD):
            return  # backward's re-gather: the weights are the forward's
        amax = torch.zeros(len(self._f8.weights), dtype=torch.float32, device=self.compute_device)
        base = self.layout.shard_start
        for a, b, k, _ in self._f8.pieces[self.layout.rank]:
            if k >= 0:
                amax[k] = self.shard[a - base : b - base].abs().max()  # one piece per weight and rank
        C.wait(C.all_reduce(amax, self.shard_group, self.stats, f"{self.name}.amax", op=dist.ReduceOp.MAX))
        self._f8_scale = float8_scale(amax)

    def _dequantize_gathered(self) -> None:
        """See [Note: int8 buffers live inside the unit's own storage] and [Note: float8 all-gather]."""
        S = self.layout.shard_numel
        nb = self._packed_chunk_nbytes()
        packed = self._packed_tail()
        start = packed.storage_offset()  # byte offset of chunk 0 in the storage
        esize = self.full_flat.element_size()
        with record_function("fsdp::dequantize"):
            for r in range(self.N):
                src = packed[r * nb : (r + 1) * nb]
                if esize * (r + 1) * S > start + r * nb:  # would overwrite its own packed chunk:
                    src = src.clone()  # a transient copy of the packed chunk (1/4 of an fp32 shard)
                if self._f8 is None:
                    dequantize_into(src, self.full_flat[r * S : (r + 1) * S], self.comm.block_size)
                    continue
                for a, b, k, pos in self._f8.pieces[r]:
                    if k >= 0:
                        vals = src[pos : pos + b - a].view(FLOAT8).float().div_(self._f8_scale[k])
                    else:
                        vals = src[pos : pos + (b - a) * esize].view(self.param_dtype)
                    self.full_flat[a:b].copy_(vals)

    def _issue_quantized_reduce(self, buf: torch.Tensor) -> Tuple[C.Pending, torch.Tensor, bool]:
        """qgZ: quantize all N chunks, all-to-all them; finish_reduce sums the dequantized chunks.

        See [Note: int8 buffers live inside the unit's own storage]: the chunks are packed in place
        at the front of `buf` (chunk r's packed bytes end before chunk r+1's values start, and
        `quantize_into` reads a chunk whole before writing), and with a 4-byte reduce dtype the
        received chunks land behind them in `buf` too; a 2-byte one receives into a pooled buffer.
        """
        b, S = self.comm.block_size, self.layout.shard_numel
        nb = packed_nbytes(S, b)
        raw = buf.view(torch.uint8)
        send = raw[: self.N * nb]
        with record_function("fsdp::quantize"):
            for r in range(self.N):
                quantize_into(buf[r * S : (r + 1) * S], send[r * nb : (r + 1) * nb], b)
        pooled = raw.numel() < 2 * self.N * nb
        if pooled:
            recv = self.ctx.acquire_buffer(self, self.N * nb, torch.uint8, self.compute_device, "qrecv")
        else:
            recv = raw[self.N * nb : 2 * self.N * nb]
        return C.all_to_all(recv, send, self.reduce_group, self.stats, self.name), recv, pooled

    # [Note: hpZ secondary shards]
    # With reshard_after_forward=k (1 < k < N), resharding after forward keeps a secondary shard:
    # this rank's 1/k of the gathered flat buffer (N S / k elements), so the backward re-gather is an
    # all-gather over k ranks (intra-node in ZeRO++) instead of N. The secondary shard is dropped
    # when backward ends; the next forward gathers from the primary (updated) shards again.
    def set_secondary(self, group: dist.ProcessGroup, k: int, index: int) -> None:
        self._hpz = (group, k, index)

    def reshard_after_forward_step(self) -> None:
        # no secondary shard for a unit that backward does not gather (set_unshard_in_backward(False))
        if self._hpz is None or self.state != UnitState.UNSHARDED or not self.unshard_in_backward:
            self.reshard()
            return
        group, k, idx = self._hpz
        M = self.layout.padded_total // k
        if self._secondary is None:
            self._secondary = torch.empty(M, dtype=self.param_dtype, device=self.compute_device)
        elif self._secondary.untyped_storage().nbytes() == 0:
            self._secondary.untyped_storage().resize_(M * self._secondary.element_size())
        self._secondary.copy_(self.full_flat[idx * M : (idx + 1) * M])
        self.reshard()
        self._secondary_valid = True

    def drop_secondary(self) -> None:
        self._secondary_valid = False
        if self._secondary is not None:
            self._secondary.untyped_storage().resize_(0)
