"""Public policy dataclasses and the state-machine enums of the sharded engine.

Everything here is frozen and free of torch.distributed calls; the rest of the engine imports
from this file, never the other way round (api -> flat -> collectives -> unit -> state -> hooks
-> fully_shard).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


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
    """ZeRO++-style int8 communication (off unless passed to `fully_shard(..., comm_policy=...)`).

    params: all-gather int8 values plus one fp32 absmax scale per `block_size` values (qwZ); the
        fp32 master shard stays exact, only the gathered compute copy is approximate.
    grads: replace the reduce-scatter by an all-to-all of int8-quantized chunks and sum the
        dequantized chunks locally in fp32 (qgZ); int8 cannot be summed on the wire.
    Bytes per element on the wire: 1 + 4/block_size (1.016 for 256), vs 2 for bf16 and 4 for fp32.
    """

    params: bool = True
    grads: bool = True
    block_size: int = 256

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 4:
            raise ValueError(
                f"QuantizedCommPolicy.block_size={self.block_size}: use a positive multiple of 4 (e.g. 256)"
            )


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
