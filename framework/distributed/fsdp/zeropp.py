"""Low-precision communication on the engine: ZeRO++ int8 (qwZ, qgZ) with its block-quantization
kernels, the float8 gather of float8 training, and hpZ secondary shards.

The kernels and plans live here; codec.py's `GatherCodec` (what a unit holds as `unit.codec`)
packs and unpacks the quantized gather inside the unit's own storage (int8 blocks or float8 per
parameter, one design) and keeps hpZ's secondary shard; reduce.py calls `issue_quantized_reduce`
for the quantized gradient all-to-all. See `QuantizedCommPolicy` in api.py and
`reshard_after_forward=<int>` in fully_shard.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from . import collectives as C
from .flat import FlatLayout

# ---- int8 block quantization (ZeRO++ qwZ/qgZ) -------------------------------------------------
# A packed block-quantized buffer of n values (n a multiple of the block) is a uint8 tensor of
# n + 4 n / block bytes: n int8 values, then n / block fp32 scales (absmax / 127).


def packed_nbytes(n: int, block: int) -> int:
    return n + 4 * (n // block)


# Quantization works through a unit in pieces of _PIECE blocks, so its temporaries (fp32 copies,
# the int8 values) stay a few MB whatever the unit's size; see also [Note: int8 buffers live
# inside the unit's own storage] in codec.py, which relies on the write order below.
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
# unit's own storage] in codec.py) and are unpacked front to back the same way.
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


def issue_quantized_reduce(
    buf: torch.Tensor, N: int, S: int, b: int, group: dist.ProcessGroup, stats: C.CommStats, name: str, acquire
) -> Tuple[C.Pending, torch.Tensor, bool]:
    """qgZ: quantize all N chunks of `buf` (S values each, blocks of `b`), all-to-all them over
    `group`; the reduction sums the dequantized chunks. `acquire(nbytes)` gives a pooled buffer.

    See [Note: int8 buffers live inside the unit's own storage]: the chunks are packed in place
    at the front of `buf` (chunk r's packed bytes end before chunk r+1's values start, and
    `quantize_into` reads a chunk whole before writing), and with a 4-byte reduce dtype the
    received chunks land behind them in `buf` too; a 2-byte one receives into a pooled buffer.
    """
    nb = packed_nbytes(S, b)
    raw = buf.view(torch.uint8)
    send = raw[: N * nb]
    with record_function("fsdp::quantize"):
        for r in range(N):
            quantize_into(buf[r * S : (r + 1) * S], send[r * nb : (r + 1) * nb], b)
    pooled = raw.numel() < 2 * N * nb
    recv = acquire(N * nb) if pooled else raw[N * nb : 2 * N * nb]
    return C.all_to_all(recv, send, group, stats, name), recv, pooled
