"""Public policy dataclasses and the state-machine enums of the sharded engine.

Everything here is frozen and free of torch.distributed calls; the rest of the engine imports
from this file, never the other way round (api -> flat -> collectives -> unit -> state -> hooks
-> fully_shard).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the gathered compute copy and of the gradient reduction (FSDP2 semantics).

    The sharded master parameters, their gradients and the optimizer state stay in the dtype the
    model was built in (fp32); only the communication buffers and the gathered parameters use
    `param_dtype`.
    """

    param_dtype: Optional[torch.dtype] = None  # dtype of gathered params used by forward/backward; None = keep
    reduce_dtype: Optional[torch.dtype] = None  # dtype of the gradient reduce-scatter; None = param_dtype
    output_dtype: Optional[torch.dtype] = None  # cast floating outputs of the module to this; None = leave
    cast_forward_inputs: bool = True  # cast floating inputs of the module to param_dtype
    # ZeRO++ int8 communication with the defaults of QuantizedCommPolicy (our extension; torch's
    # policy has no such field). Same as fully_shard(..., comm_policy=QuantizedCommPolicy()).
    quantized_comm: bool = False


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: shards, gradients and optimizer state on the compute device (FSDP2's base
    policy; `fully_shard(offload_policy=OffloadPolicy())` is the same as passing none)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded params, grads and optimizer state on the CPU; compute on the accelerator.

    The gathered parameters live on the compute device for the duration of the unit's use; the
    reduced gradient shard is copied back to the CPU. On a CPU-only machine it is a no-op that
    still runs correctly.
    """

    pin_memory: bool = True  # pin the CPU shards so host<->device copies are asynchronous (CUDA only)


@dataclass(frozen=True)
class QuantizedCommPolicy:
    """Low-precision communication (off unless passed to `fully_shard(..., comm_policy=...)`), in
    one of two formats that share the packed gather (zeropp.py):

    dtype="int8" (ZeRO++):
      params: all-gather int8 values plus one fp32 absmax scale per `block_size` values (qwZ); the
        fp32 master shard stays exact, only the gathered compute copy is approximate.
      grads: replace the reduce-scatter by an all-to-all of int8-quantized chunks and sum the
        dequantized chunks locally in fp32 (qgZ); int8 cannot be summed on the wire.
      Bytes per element on the wire: 1 + 4/block_size (1.016 for 256), vs 2 for bf16 and 4 for fp32.
    dtype="float8" (float8 training, see [Note: float8 all-gather] in zeropp.py):
      params: the weights `float8_filter(module)` accepts (the float8 linears) are gathered as
        float8 e4m3 with one scale per parameter (its absmax over every shard, agreed by one small
        all-reduce per unit and forward), 1 byte per element; the unit's other parameters travel in
        the param dtype. The float8 linear then casts exactly the gathered values (same scale).
      grads: never quantized (reductions stay in the reduce dtype); `grads` must stay unset/False.
    """

    params: bool = True
    grads: Optional[bool] = None  # None: True for int8, False for float8
    block_size: int = 256  # int8 only
    dtype: str = "int8"  # "int8" | "float8"
    # float8: which modules' `weight` is gathered as float8 (None: every nn.Linear)
    float8_filter: Optional[Callable[[nn.Module], bool]] = None

    def __post_init__(self) -> None:
        if self.dtype not in ("int8", "float8"):
            raise ValueError(f"QuantizedCommPolicy.dtype={self.dtype!r}: choose 'int8' or 'float8'")
        if self.block_size <= 0 or self.block_size % 4:
            raise ValueError(
                f"QuantizedCommPolicy.block_size={self.block_size}: use a positive multiple of 4 (e.g. 256)"
            )
        if self.grads is None:
            object.__setattr__(self, "grads", self.dtype == "int8")
        elif self.grads and self.dtype == "float8":
            raise ValueError(
                "QuantizedCommPolicy(dtype='float8') quantizes the parameter gathers only (gradients are "
                "reduced in the reduce dtype); drop grads=True"
            )

    @property
    def align(self) -> int:
        """Elements each rank's shard is rounded up to (the int8 block; float8 needs none)."""
        return self.block_size if self.dtype == "int8" else 1

    def float8_weight(self, module: nn.Module, attr: str) -> bool:
        if self.dtype != "float8" or attr != "weight":
            return False
        if self.float8_filter is not None:
            return bool(self.float8_filter(module))
        return isinstance(module, nn.Linear)


class UnitState(enum.Enum):
    """Where a unit's full parameters are."""

    SHARDED = "sharded"  # only the local shard exists; the unsharded storage has size 0
    UNSHARDING = "unsharding"  # all-gather issued (async), not waited on yet
    UNSHARDED = "unsharded"  # full parameters valid and exposed to the modules


class TrainingPhase(enum.Enum):
    """Where the step is, as seen by the root of a sharded model."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"  # backward started, units being re-gathered
    POST_BACKWARD = "post_backward"  # final callback: waiting for reductions


class UnitContext(Protocol):
    """What a unit (unit.py, with the reduction and the codec it holds) asks of the shared
    state of the model it belongs to: `ShardContext` (context.py), which is built over units and
    imports unit.py, never the reverse."""

    step: int  # forward/backward rounds of the model
    phase: TrainingPhase

    def acquire_buffer(self, unit, numel: int, dtype: torch.dtype, device: torch.device, tag: str) -> torch.Tensor: ...

    def release_buffer(self, buf: torch.Tensor) -> None: ...

    def add_pending(self, unit) -> None: ...

    def on_unit_ready(self, unit) -> None: ...
