"""Flat per-unit storage: where each parameter of a unit lives in the unit's flat buffers.

[Note: flat storage]
A unit's parameters are laid out one after the other in a flat buffer of T elements, padded to
N x S (S = ceil(T / N), rounded up to the quantization block when int8 communication is on). Rank
r owns the contiguous slice [r S, (r+1) S). Consequences, all deliberate:
  * the all-gather output *is* the concatenation of the full parameters, so every full parameter
    is a view into it (no copy-out), and the gathered buffer is the all-gather receive buffer;
  * the reduce-scatter input is one flat gradient buffer with the same layout (one copy-in of the
    gradients that autograd produced, no rank-major interleave);
  * a parameter's local piece (what the optimizer sees) is the 1-D intersection of its range with
    this rank's slice, a view of the fp32 shard buffer; it may be empty;
  * a parameter's per-parameter Shard(0) chunk (what checkpoints need) generally lives on other
    ranks, so `state_dict()` and the optimizer state dict redistribute (one all-gather per unit
    and state key), only at checkpoint time.
Measured (torch.profiler, 27M GPT, 2 gloo ranks, one step, bench/engine.py model): torch FSDP2's
per-parameter dim-0 layout spends its copy budget on copy-out after every all-gather and copy-in
(cat) before every reduce-scatter, on top of gloo's own internal copies; with flat storage plus the
gloo-aware collectives of collectives.py our hot path is down to ~24 ms/step of aten::copy_ (from
~265 ms/step with flat storage over gloo's stock all_gather_single/reduce_scatter_single), and the
step runs at ~0.5x FSDP2's time (bench/RESULTS.md). Per-parameter chunks would have made
checkpoints free but every step dearer; checkpoints are rare, steps are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn


@dataclass(frozen=True)
class TPSpec:
    """A parameter that arrived as a tensor-parallel DTensor: what the forward must see again."""

    mesh: Any  # the 1-D tp DeviceMesh
    placements: tuple
    shape: torch.Size  # global (full) shape
    stride: tuple


@dataclass(kw_only=True)
class FlatEntry:
    """One distinct parameter of a unit (tied parameters appear once, with several users)."""

    users: List[Tuple[nn.Module, str, str]]  # (owning submodule, attribute name, FQN relative to the unit module)
    shape: torch.Size
    offset: int  # start in the unsharded flat buffer
    numel: int
    requires_grad: bool
    tp: Optional[TPSpec] = None  # set when the parameter is a TP DTensor; shape is then its TP-local shape
    local_lo: int = 0  # intersection of [offset, offset+numel) with this rank's slice, in flat coordinates
    local_hi: int = 0

    @property
    def local_numel(self) -> int:
        return self.local_hi - self.local_lo

    @property
    def global_shape(self) -> torch.Size:
        return self.tp.shape if self.tp is not None else self.shape


@dataclass
class FlatLayout:
    entries: List[FlatEntry]
    total: int  # T: elements of real parameters
    shard_numel: int  # S: elements each rank owns (padded)
    world: int  # N: ranks in the shard group
    rank: int
    padded_total: int = field(init=False)

    def __post_init__(self) -> None:
        self.padded_total = self.shard_numel * self.world
        lo, hi = self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel
        for e in self.entries:
            e.local_lo = min(max(e.offset, lo), hi)
            e.local_hi = max(min(e.offset + e.numel, hi), e.local_lo)

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def shard_slice(self, e: FlatEntry) -> slice:
        """Where `e`'s local piece lives in this rank's shard buffer."""
        return slice(e.local_lo - self.shard_start, e.local_hi - self.shard_start)

    def piece_slice(self, e: FlatEntry) -> slice:
        """Where `e`'s local piece lives inside the flattened full parameter."""
        return slice(e.local_lo - e.offset, e.local_hi - e.offset)


def build_layout(entries: List[FlatEntry], world: int, rank: int, align: int = 1) -> FlatLayout:
    offset = 0
    for e in entries:
        e.offset = offset
        offset += e.numel
    total = offset
    shard = max(1, -(-total // world))
    shard = -(-shard // align) * align
    return FlatLayout(entries=entries, total=total, shard_numel=shard, world=world, rank=rank)


def dim0_chunk(shape: torch.Size, world: int, rank: int) -> Tuple[int, int]:
    """Rows [lo, hi) of dim 0 that rank `rank` owns under torch.chunk semantics (DTensor Shard(0))."""
    rows = shape[0]
    per = -(-rows // world) if rows else 0
    lo = min(rank * per, rows)
    return lo, min(lo + per, rows)


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
