"""Checkpoint views of a sharded model: per-parameter Shard(0) DTensors built on demand (Shard(d)
where `fully_shard`'s shard_placement_fn chose d: [Note: placements name the checkpoint's split]).

The engine stores flat per-unit slices (see [Note: flat storage] in flat.py); checkpoints want
one DTensor per parameter, split on dim 0 in torch.chunk order, so DCP can reshard across world
sizes and so our files and torch `fully_shard` files are interchangeable. The redistribution is an
all-gather of the unit's flat slice (one unit in memory at a time) followed by local slicing; it
runs only inside `state_dict()` / `load_state_dict()` / `get_state_dicts` / `set_state_dicts`, all
of which are therefore collective: call them on every rank.

`get_state_dicts(model, optim)` / `set_state_dicts(model, optim, model_sd, optim_sd)` produce and
accept exactly the format of torch.distributed.checkpoint.state_dict.get_state_dict/set_state_dict
for a model sharded with torch's fully_shard: original FQN keys, DTensor values, optimizer state
keyed by FQN with FQN lists in param_groups.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from . import collectives as C
from .flat import FlatEntry, dim0_chunk
from .unit import owner_of, sharded_units

if TYPE_CHECKING:
    from .unit import ShardUnit


def _placements(unit: "ShardUnit", ndim: int, dim: int = 0) -> list:
    inner = Shard(dim) if ndim > 0 else Replicate()
    return [Replicate(), inner] if unit.mesh.ndim == 2 else [inner]


def _gather_flat(unit: "ShardUnit", local: torch.Tensor) -> torch.Tensor:
    """All-gather one shard-sized fp32 flat slice into the unit's full flat layout."""
    local = local.to(unit.compute_device)  # CPU-offloaded shards travel via the compute device
    full = torch.empty(unit.layout.padded_total, dtype=local.dtype, device=local.device)
    return C.all_gather_object_free(full, local.contiguous(), unit.shard_group)


def _to_dtensor(unit: "ShardUnit", e: FlatEntry, full_flat: torch.Tensor) -> DTensor:
    full = full_flat[e.offset : e.offset + e.numel].view(e.shape)
    if unit.state_mesh is not unit.mesh:
        # Tensor parallel composition: ([Replicate() over dp_replicate,] Shard(0) over dp_shard, the
        # TP placement over tp) on the 2-D or 3-D state mesh. Built from the global value so nested
        # sharding of one dim follows DTensor's own order.
        if e.tp is not None:
            glob = DTensor.from_local(
                full, e.tp.mesh, e.tp.placements, run_check=False, shape=e.tp.shape, stride=e.tp.stride
            ).full_tensor()
            tp_placement = e.tp.placements[0]
        else:
            glob, tp_placement = full, Replicate()
        dp_placements = _placements(unit, glob.dim())
        return distribute_tensor(glob, unit.state_mesh, [*dp_placements, tp_placement], src_data_rank=None)
    if full.dim() == 0:
        local = full.clone()
    else:
        lo, hi = dim0_chunk(e.shape, unit.N, unit.layout.rank, e.state_dim)
        local = full.narrow(e.state_dim, lo, hi - lo).clone(memory_format=torch.contiguous_format)
    placements = _placements(unit, full.dim(), e.state_dim)
    return DTensor.from_local(local, unit.mesh, placements, shape=full.shape, stride=full.stride())


def _full_value(v) -> torch.Tensor:
    return v.full_tensor() if isinstance(v, DTensor) else v


def _local_piece(unit: "ShardUnit", e: FlatEntry, full: torch.Tensor) -> torch.Tensor:
    if e.tp is not None:  # the global value -> this rank's TP-local tensor, which the engine shards
        full = distribute_tensor(full, e.tp.mesh, e.tp.placements, src_data_rank=None).to_local()
    if full.numel() != e.numel:
        raise ValueError(
            f"load: value of shape {tuple(full.shape)} for a parameter of shape {tuple(e.shape)}; "
            f"the checkpoint belongs to a different model"
        )
    return full.reshape(-1)[unit.layout.piece_slice(e)].to(unit.shard.device).clone()


def register_state_dict_hooks(unit: "ShardUnit", module: nn.Module, member: int = 0) -> None:
    """On `module` (the unit's module, or member `member` of its group): its state dict holds
    Shard(0) DTensors of the unit's parameters used under it, and loads them back."""

    def mine(e):
        return [fqn for (_, _, fqn), k in zip(e.users, e.members or [0] * len(e.users)) if k == member]

    def post_state_dict(module, state_dict, prefix, local_metadata):
        full_flat = _gather_flat(unit, unit.shard)  # collective: every member's hook gathers alike
        for e in unit.entries:
            dt = _to_dtensor(unit, e, full_flat)  # every entry on every rank: may be collective (TP)
            for fqn in mine(e):
                if prefix + fqn in state_dict:
                    state_dict[prefix + fqn] = dt

    def pre_load(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for e in unit.entries:
            done: Optional[torch.Tensor] = None
            for fqn in mine(e):
                key = prefix + fqn
                if key in state_dict:
                    if done is None:
                        done = _local_piece(unit, e, _full_value(state_dict[key]))
                    state_dict[key] = done

    module.register_state_dict_post_hook(post_state_dict)
    module.register_load_state_dict_pre_hook(pre_load)


# ------------------------------------------------------------------ optimizer
def _units(model: nn.Module) -> List["ShardUnit"]:
    return sharded_units(model)


def _init_optimizer_state(optim: torch.optim.Optimizer) -> None:
    """Create the optimizer's state with a zero-lr step on zero grads (so DCP has a template)."""
    saved = []
    for g in optim.param_groups:
        saved.append(g["lr"])
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optim.step()
    for g, lr in zip(optim.param_groups, saved):
        g["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _param_ids(optim: torch.optim.Optimizer) -> Dict[int, int]:
    ids, i = {}, 0
    for g in optim.param_groups:
        for p in g["params"]:
            ids[id(p)] = i
            i += 1
    return ids


def _sharded_keys(states: List[dict], params: List[torch.Tensor]) -> List[str]:
    keys = set()
    for st, p in zip(states, params):
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape == p.shape:
                keys.add(k)
    return sorted(keys)


def _state_dtensors(unit: "ShardUnit", pairs: List[tuple], states: List[dict]) -> List[dict]:
    """Per (entry, sharded parameter) of `pairs`, its optimizer state's sharded tensors as the
    parameter's DTensors: one gather of the unit's flat layout per state key (collective over the
    unit's shard group)."""
    out: List[dict] = [{} for _ in pairs]
    for k in _sharded_keys(states, [sp for _, sp in pairs]):
        local = torch.zeros(unit.layout.shard_numel, dtype=torch.float32, device=unit.shard.device)
        for (e, _), st in zip(pairs, states):
            if k in st:
                local[unit.layout.shard_slice(e)] = st[k]
        full_flat = _gather_flat(unit, local)
        for (e, _), st, dts in zip(pairs, states, out):
            if k in st:
                dts[k] = _to_dtensor(unit, e, full_flat).to(st[k].dtype)
    return out


def _state_piece(unit: "ShardUnit", e: FlatEntry, key: str, value):
    """A loaded optimizer state value as this rank's piece: a tensor of the parameter's whole size
    (a DTensor, or a plain whole tensor) is cut to the piece; the step and local pieces stay."""
    whole = isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == math.prod(e.global_shape)
    return _local_piece(unit, e, _full_value(value)) if key != "step" and whole else value


# [Note: the optimizer's own state_dict holds DTensors]
# FSDP2's optimizer state is DTensors, so `optimizer.state_dict()` and torch's
# `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` / `set_optimizer_state_dict`
# (which go through it) save per-parameter Shard(0) state that DCP reshards. Ours keeps the state
# as flat local pieces (what the optimizer steps on), so `prepare_optimizer(optimizer)` (the
# explicit opt-in, optim_check.py) registers two public hooks on that optimizer: `state_dict()` turns each sharded
# piece into its parameter's DTensor (collective, like the model's state_dict), and
# `load_state_dict()` turns a DTensor, or a whole tensor, back into this rank's piece. Pieces
# already local (what `set_state_dicts` passes) are left as they are.
def hook_optimizer_state_dict(optimizer: torch.optim.Optimizer) -> None:
    """Register the hooks of the note above on `optimizer` (once)."""
    if getattr(optimizer, "_fsdp_state_dict_hooks", False):
        return
    optimizer._fsdp_state_dict_hooks = True
    optimizer.register_state_dict_post_hook(_optimizer_state_to_dtensors)
    optimizer.register_load_state_dict_pre_hook(_optimizer_state_to_pieces)


def _params_by_key(optimizer, state_dict: dict) -> dict:
    """The optimizer's parameter under each key of `state_dict` (ints from `state_dict()`, names
    from torch's `set_optimizer_state_dict`): the groups list them in the same order."""
    keys = [k for g in state_dict["param_groups"] for k in g["params"]]
    return dict(zip(keys, (p for g in optimizer.param_groups for p in g["params"])))


def _optimizer_state_to_dtensors(optimizer, state_dict: dict) -> dict:
    by_key = _params_by_key(optimizer, state_dict)
    index = {id(p): k for k, p in by_key.items()}
    units: Dict[int, "ShardUnit"] = {}
    for p in by_key.values():  # every rank lists the same parameters: the same units, in the same order
        owner = owner_of(p)
        if owner is not None:
            units.setdefault(id(owner[0]), owner[0])
    state = dict(state_dict["state"])
    for unit in units.values():
        pairs = [(e, sp) for e, sp in zip(unit.entries, unit.sharded_params) if id(sp) in index]
        dts = _state_dtensors(unit, pairs, [state.get(index[id(sp)], {}) for _, sp in pairs])
        for (_, sp), d in zip(pairs, dts):
            if d:  # a new dict: the values of state_dict()'s are the optimizer's own
                state[index[id(sp)]] = {**state[index[id(sp)]], **d}
    return {**state_dict, "state": state}


def _optimizer_state_to_pieces(optimizer, state_dict: dict) -> dict:
    by_key = _params_by_key(optimizer, state_dict)
    state = {}
    for i, st in state_dict["state"].items():
        owner = owner_of(by_key[i]) if i in by_key else None
        if owner is None:
            state[i] = st
            continue
        unit, idx = owner
        state[i] = {k: _state_piece(unit, unit.entries[idx], k, v) for k, v in sorted(st.items())}
    return {**state_dict, "state": state}


def get_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[dict, dict]:
    """(model_sd, optim_sd) in the format of torch's `get_state_dict` for a `fully_shard`-ed model. Collective."""
    model_sd = model.state_dict()
    if not optimizer.state:
        _init_optimizer_state(optimizer)
    fqn_of = {}
    for name, p in model.named_parameters():
        fqn_of.setdefault(id(p), name)
    state: Dict[str, dict] = {}
    handled = set()
    for unit in _units(model):
        entries = [(e, sp) for e, sp in zip(unit.entries, unit.sharded_params) if e.requires_grad]
        sts = [optimizer.state.get(sp, {}) for _, sp in entries]
        for (_, sp), d in zip(entries, _state_dtensors(unit, entries, sts)):
            if d:
                state.setdefault(fqn_of[id(sp)], {}).update(d)
        for (_, sp), st in zip(entries, sts):
            handled.add(id(sp))
            for k, v in st.items():
                if k not in state.get(fqn_of[id(sp)], {}):
                    state.setdefault(fqn_of[id(sp)], {})[k] = v
    for g in optimizer.param_groups:  # parameters outside the engine pass through
        for p in g["params"]:
            if id(p) not in handled and p in optimizer.state:
                state[fqn_of[id(p)]] = dict(optimizer.state[p])
    groups = []
    for g in optimizer.param_groups:
        gg = {k: v for k, v in g.items() if k != "params"}
        gg["params"] = [fqn_of[id(p)] for p in g["params"]]
        groups.append(gg)
    return model_sd, {"state": state, "param_groups": groups}


def set_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load what `get_state_dicts` (ours or torch's, any world size) produced. Collective."""
    model.load_state_dict(model_sd)
    by_name = dict(model.named_parameters(remove_duplicate=False))
    fqns_of: Dict[int, List[str]] = {}
    for name, p in by_name.items():
        fqns_of.setdefault(id(p), []).append(name)
    ids = _param_ids(optimizer)
    src = optim_sd["state"]
    new_state: Dict[int, dict] = {}
    handled = set()
    for unit in _units(model):
        for e, sp in zip(unit.entries, unit.sharded_params):
            fqn = next((f for f in fqns_of.get(id(sp), []) if f in src), None)
            if fqn is None or id(sp) not in ids:
                continue
            new_state[ids[id(sp)]] = {k: _state_piece(unit, e, k, v) for k, v in sorted(src[fqn].items())}
            handled.add(id(sp))
    for fqn, st in src.items():
        p = by_name.get(fqn)
        if p is not None and id(p) not in handled and id(p) in ids:
            new_state[ids[id(p)]] = {k: _full_value(v) for k, v in st.items()}
    groups = []
    for g, sg in zip(optimizer.param_groups, optim_sd["param_groups"]):
        gg = {k: v for k, v in sg.items() if k != "params"}
        gg["params"] = [ids[id(p)] for p in g["params"]]
        groups.append(gg)
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})
