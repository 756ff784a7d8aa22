"""ZeRO++ on the engine: int8 communication (qwZ, qgZ) with its block-quantization kernels, and
hpZ secondary shards.

`ZeroPlusPlus` is the part of `ShardUnit` (unit.py) for these: the int8 gather's packing and
unpacking inside the unit's own storage, the quantized gradient all-to-all, and the secondary
shard kept after forward. See `QuantizedCommPolicy` in api.py and `reshard_after_forward=<int>`
in fully_shard.py.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import collectives as C
from .api import UnitState

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


class ZeroPlusPlus:
    """int8 gathers and reductions, and hpZ secondary shards (mixed into `ShardUnit`)."""

    def _packed_tail(self) -> torch.Tensor:
        """The last N x packed-shard bytes of the (resized) unsharded storage, as uint8."""
        nb = packed_nbytes(self.layout.shard_numel, self.comm.block_size) * self.N
        total = self.storage.nbytes()
        t = torch.empty(0, dtype=torch.uint8, device=self.compute_device)
        return t.set_(self.storage, total - nb, (nb,), (1,))

    def _dequantize_gathered(self) -> None:
        """See [Note: int8 buffers live inside the unit's own storage]."""
        S, b = self.layout.shard_numel, self.comm.block_size
        nb = packed_nbytes(S, b)
        packed = self._packed_tail()
        start = packed.storage_offset()  # byte offset of chunk 0 in the storage
        esize = self.full_flat.element_size()
        with record_function("fsdp::dequantize"):
            for r in range(self.N):
                src = packed[r * nb : (r + 1) * nb]
                if esize * (r + 1) * S > start + r * nb:  # would overwrite its own packed chunk:
                    src = src.clone()  # a transient copy of the int8 chunk (1/4 of an fp32 shard)
                dequantize_into(src, self.full_flat[r * S : (r + 1) * S], b)

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
        if self._hpz is None or self.state != UnitState.UNSHARDED:
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
