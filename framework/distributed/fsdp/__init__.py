"""Our fully sharded data-parallel engine (ZeRO-3 / ZeRO-2 / hybrid / no-shard), FSDP2-compatible API.

    from framework.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, clip_grad_norm_
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

See api.py for the policies, flat.py for the storage layout, state_dict.py for checkpoints.
"""

from .api import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedCommPolicy, TrainingPhase, UnitState
from .clip import clip_grad_norm_
from .collectives import set_host_transport
from .fully_shard import ShardedModule, fully_shard
from .host_heap import set_host_memory_trim
from .state_dict import get_state_dicts, set_state_dicts
from .unit import sharded_units

__all__ = [
    "fully_shard",
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
    "set_host_transport",
    "set_host_memory_trim",
]
