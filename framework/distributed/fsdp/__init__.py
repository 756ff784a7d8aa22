"""Our fully sharded data-parallel engine (ZeRO-3 / ZeRO-2 / hybrid / no-shard), FSDP2-compatible API.

    from framework.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, clip_grad_norm_
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Files, in import order: api.py (policies, state enums), flat.py (storage layout), transport.py and
host/ (how a group moves bytes), collectives.py, zeropp.py and reduce.py (parts of a unit), unit.py,
context.py (one model's shared state), hooks.py, mesh.py (groups and meshes), state_dict.py,
clip.py (global gradient norms, also for torch's clip_grad_norm_), optim_check.py (what the
optimizer sees: original_shape), sharded_module.py (FSDP2's FSDPModule methods), fully_shard.py
(the entry point).
"""

from .api import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedCommPolicy,
    TrainingPhase,
    UnitState,
)
from .clip import clip_grad_norm_
from .fully_shard import fully_shard
from .host import set_host_transport
from .optim_check import original_shape
from .sharded_module import FSDPModule, ShardedModule, UnshardHandle, register_fsdp_forward_method
from .state_dict import get_state_dicts, set_state_dicts
from .unit import sharded_units

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "OffloadPolicy",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "CPUOffloadPolicy",
    "QuantizedCommPolicy",
    "clip_grad_norm_",
    "get_state_dicts",
    "set_state_dicts",
    "ShardedModule",
    "UnitState",
    "TrainingPhase",
    "sharded_units",
    "original_shape",
    "set_host_transport",
]
