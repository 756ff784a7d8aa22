"""Our fully sharded data-parallel engine (ZeRO-3 / ZeRO-2 / hybrid / no-shard), FSDP2-compatible API.

    from framework.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy, clip_grad_norm_
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Files, in import order: api.py (policies, state enums), flat.py (storage layout), mesh.py (the
groups, meshes and transports of a world, owned by `EngineGroups`), transport.py and host/ (how a
group moves bytes), collectives.py, zeropp.py (quantization kernels), reduce.py and codec.py
(the objects a unit holds: its gradient reduction and its gather encoding), unit.py, context.py
(one model's shared state), hooks.py, state_dict.py, views.py (what torch sees: pieces that
describe themselves, so torch's own clip_grad_norm_ is global), clip.py (the engine's spelling of
the global norm), optim_check.py (what the optimizer sees: original_shape; prepare_optimizer, the
opt-in checks and state-dict format; optimizer_step, an elementwise step on the plain data),
sharded_module.py (FSDP2's FSDPModule methods),
fully_shard.py (the entry point). Where shard boundaries fall: framework/distributed/shard_layout.py
(torch-free; the planner uses it too).

[Note: the buffers of a unit]
Every buffer a unit (unit.py's `ShardUnit`: one `fully_shard` call's parameters) holds, by its
attribute's path: on the unit itself (storage and gather), on `unit.reduction` (reduce.py's
`GradReduction`: the gradients) or on `unit.codec` (codec.py's `GatherCodec`: the gather's
encoding); tests/distributed/test_engine_state.py checks each path exists on a built unit and
that every tensor the unit, its reduction and its codec hold is named here. N: ranks of the
shard group; S: elements of one rank's shard (`layout.shard_numel`); T = N x S
(`layout.padded_total`); see [Note: flat storage] in flat.py.
  unit.shard           this rank's S elements of the unit's parameters, in the shard dtype (the
                       fp32 master copy), on the compute device (or the host with offload).
                       Persistent.
  unit.sharded_params  the sharded parameters: `ShardPiece` views of `shard`, one per parameter,
                       what `named_parameters()` and the optimizer see (views.py).
  unit.reduction.grad_shard
                       the S-element gradient shard, allocated by a backward's reduction and set
                       only while it is in flight; then the sharded parameters' `.grad` views own
                       it until `zero_grad` ([Note: gradient shards live from backward to
                       zero_grad] in reduce.py).
  unit.full_flat       the gathered (unsharded) buffer: T elements in the param dtype, the
                       all-gather's receive buffer, and the reduce-scatter's input when the
                       gradients are written into it ([Note: gradients reuse the gathered storage]
                       in reduce.py). When nothing is gathered (one rank, no dtype change) it is
                       `shard` itself.
  unit.storage         `full_flat`'s memory, resized to 0 when the unit reshards and back when it
                       unshards; None when `full_flat` is `shard`.
  unit.full_params     the unsharded parameters the modules compute with: views of `full_flat`,
                       the same tensor objects for the model's life ([Note: unsharded storage keeps
                       its identity] in unit.py).
  unit.codec.send      the all-gather's send buffer: `shard` cast to the param dtype (or copied to
                       the compute device under offload) for one gather, freed when it is waited
                       on; None when `shard` is sent as it is.
  unit._gather         the all-gather in flight (collectives.Pending: its work handle and output).
  unit.codec.secondary hpZ: this rank's secondary shard, T / k elements of `full_flat` kept after
                       forward so backward gathers over k ranks ([Note: hpZ secondary shards] in
                       codec.py); its memory is released when backward ends.
  unit.reduction.accum T elements of unsharded gradients summed over micro-steps without gradient
                       sync (`set_requires_gradient_sync(False)`); freed by the synced reduction.
  unit.reduction.partial
                       hybrid sharding with `set_requires_all_reduce(False)`: the reduce-scattered
                       gradient shard not yet all-reduced over the replicas.
  unit.reduction.pending
                       the gradient reduction in flight (reduce.py's `_Reduction`: the pending
                       collective, and the pooled input, output, receive scratch and qgZ chunks
                       it gives back to the pool when `finish_reduce` drains it).
  unit.codec.f8_scale  float8 gathers: the per-weight scales of the last gather (`unit.codec.f8`
                       says which pieces go as float8); None when the unit has no float8 weight.
  int8 / float8 packed buffers have no attribute: the packed parameter chunks are received into
                       the tail of `storage` and dequantized front to back into `full_flat`, and
                       qgZ's packed gradient chunks are written into the reduce-scatter input
                       ([Note: int8 buffers live inside the unit's own storage] in codec.py).
  unit.ctx._pool       the model's buffer pool (context.py's `ShardContext`, shared by its units;
                       [Note: the gradient buffer pool]): free buffers by (tag, dtype, device):
                       reduce-scatter inputs "in", outputs "out", receive scratch "rs", qgZ's "q"
                       and "qrecv"; `unit.ctx._owned` holds every buffer it made, free or in use.
  unit._tp_views       tensor parallel: the DTensors over `full_params` the modules see.
  unit.stats           the unit's communication counters (collectives.CommStats), not a buffer.
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
from .optim_check import optimizer_step, original_shape, prepare_optimizer
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
    "optimizer_step",
    "ShardPiece",
    "set_host_transport",
]
