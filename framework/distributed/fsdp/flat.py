"""Flat per-unit storage: where each parameter of a unit lives in the unit's flat buffers.

[Note: flat storage]
A unit's parameters are laid out one after the other in a flat buffer of T elements, padded to
N x S (S = ceil(T / N), rounded up to the quantization block when int8 communication is on; a
boundary policy may leave gaps between parameters and a larger S: [Note: shard boundaries] in
framework/distributed/shard_layout.py). Rank r owns the contiguous slice [r S, (r+1) S). Consequences, all deliberate:
  * the all-gather output *is* the concatenation of the full parameters, so every full parameter
    is a view into it (no copy-out), and the gathered buffer is the all-gather receive buffer;
  * the reduce-scatter input is one flat gradient buffer with the same layout (one copy-in of the
    gradients that autograd produced, no rank-major interleave);
  * a parameter's local piece (what the optimizer sees) is the 1-D intersection of its range with
    this rank's slice, a view of the fp32 shard buffer; it may be empty;
  * a parameter's per-parameter Shard(0) chunk (what checkpoints need) generally lives on other
    ranks, so `state_dict()` and the optimizer state dict redistribute (one all-gather per unit
    and state key), only at checkpoint time.
Per-parameter dim-0 chunks (torch FSDP2's layout) spend the copy budget on a copy-out after every
all-gather and a copy-in (cat) before every reduce-scatter; the profiles are in bench/RESULTS.md.
They would have made checkpoints free but every step dearer; checkpoints are rare, steps are not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch
import torch.nn as nn

from ..shard_layout import granule, pack


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

    users: List[Tuple[nn.Module, str, str]]  # (owning submodule, attribute name, FQN relative to its member module)
    members: List[int] = field(default_factory=list)  # per user: which module of the unit's group it is under
    shape: torch.Size
    offset: int  # start in the unsharded flat buffer
    numel: int
    requires_grad: bool
    tp: Optional[TPSpec] = None  # set when the parameter is a TP DTensor; shape is then its TP-local shape
    local_lo: int = 0  # intersection of [offset, offset+numel) with this rank's slice, in flat coordinates
    local_hi: int = 0
    # the dim its checkpoint DTensor is split on (Shard(state_dim), FSDP2's shard_placement_fn);
    # where it lives in memory does not depend on it: [Note: placements name the checkpoint's split]
    state_dim: int = 0

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
    boundary: str = "anywhere"  # where rank boundaries may fall: [Note: shard boundaries]
    padded_total: int = field(init=False)
    gaps: List[Tuple[int, int]] = field(init=False)  # [start, end) of the flat buffer holding no parameter

    def __post_init__(self) -> None:
        self.padded_total = self.shard_numel * self.world
        self.gaps, pos = [], 0
        for e in sorted(self.entries, key=lambda e: e.offset):
            if e.offset > pos:
                self.gaps.append((pos, e.offset))
            pos = max(pos, e.offset + e.numel)
        if self.padded_total > pos:
            self.gaps.append((pos, self.padded_total))
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

    @property
    def padding(self) -> int:
        """Elements of the N x S buffer that hold no parameter (every rank's together)."""
        return self.padded_total - self.total


def row_numel(shape) -> int:
    """Elements of one row (a dim-0 slice) of a parameter of `shape`; 1 for 0-D and 1-D ones."""
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


def build_layout(
    entries: List[FlatEntry], world: int, rank: int, align: int = 1, boundary: str = "anywhere"
) -> FlatLayout:
    """Place `entries` in the flat buffer under the `boundary` policy ([Note: shard boundaries] in
    framework/distributed/shard_layout.py)."""
    sizes = [(e.numel, granule(e.numel, row_numel(e.shape), boundary)) for e in entries]
    offsets, shard = pack(sizes, world, align)
    for e, offset in zip(entries, offsets):
        e.offset = offset
    total = sum(e.numel for e in entries)
    return FlatLayout(entries=entries, total=total, shard_numel=shard, world=world, rank=rank, boundary=boundary)


def dim0_chunk(shape: torch.Size, world: int, rank: int, dim: int = 0) -> Tuple[int, int]:
    """Indices [lo, hi) of dim `dim` (0 unless given) that rank `rank` owns under torch.chunk
    semantics (DTensor Shard(dim))."""
    rows = shape[dim]
    per = -(-rows // world) if rows else 0
    lo = min(rank * per, rows)
    return lo, min(lo + per, rows)


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of `shape` (zero-size dims count as 1)."""
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(stride))
