"""Our fully sharded data-parallel engine (ZeRO-3 / ZeRO-2 / hybrid / no-shard), FSDP2-compatible API.

    from framework.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, clip_grad_norm_
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Files, in import order: api.py (policies, state enums), flat.py (storage layout), transport.py and
host/ (how a group moves bytes), collectives.py, zeropp.py and reduce.py (parts of a unit), unit.py,
context.py (one model's shared state), hooks.py, mesh.py (groups and meshes), state_dict.py,
views.py (what torch sees: pieces that describe themselves, so torch's own clip_grad_norm_ is
global), clip.py (the engine's spelling of the global norm), optim_check.py (what the optimizer
sees: original_shape; prepare_optimizer, the opt-in checks and state-dict format),
sharded_module.py (FSDP2's FSDPModule methods), fully_shard.py (the entry point). Where shard
boundaries fall: framework/distributed/shard_layout.py (torch-free; the planner uses it too).
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
from .optim_check import original_shape, prepare_optimizer
from .sharded_module import FSDPModule, ShardedModule, UnshardHandle, register_fsdp_forward_method
from .state_dict import get_state_dicts, set_state_dicts
from .unit import sharded_units
from .views import ShardPiece

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
    "prepare_optimizer",
    "ShardPiece",
    "set_host_transport",
]
