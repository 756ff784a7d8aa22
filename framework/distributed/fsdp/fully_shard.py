"""`fully_shard(module, ...)`: turn a module's not-yet-owned parameters into one sharded unit.

Applied bottom-up (each block, then the root), like FSDP2. The module's class is swapped for a
subclass of `ShardedModule` (FSDP2's `FSDPModule`; sharded_module.py), which adds FSDP2's methods.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..shard_layout import BOUNDARIES
from . import hooks
from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, QuantizedCommPolicy
from .flat import FlatEntry, TPSpec, build_layout
from .mesh import dp_tp_mesh, mesh_key, reduce_group, resolve_mesh, secondary_group
from .sharded_module import ShardedModule
from .state_dict import register_state_dict_hooks
from .unit import ShardUnit, claim, claimed_by, owner_of, piece_spec
from .views import ShardPiece

# [Note: one sharded class per module class, for the process]
# `fully_shard` swaps a module's class for `FSDP<Class>` (ShardedModule first in the MRO; FSDP2's
# name for it). The
# table below is process-wide on purpose, as FSDP2's own class cache is: every instance of a
# class, whichever model or world it belongs to, must get the *same* sharded class, so that
# `type(a) is type(b)`, isinstance checks and pickling by qualified name agree across models
# and across `fully_shard` calls. The value is a pure function of the key (a class made from
# it, holding no state), so there is nothing per model to own, and an entry lives as long as
# the class it was made from would anyway (classes are rarely collected). Ranks that are threads
# of one process shard at the same time: the first class stored wins (`setdefault` is atomic), so
# they too get one class.
_CLASS_CACHE: Dict[type, type] = {}


class ShardedTwiceError(ValueError, AssertionError):
    """`fully_shard` applied to a module it already took. A ValueError, as the engine's other
    refusals of bad input are, and FSDP2's AssertionError (with its sentence first), which code
    written for FSDP2 catches."""


def _sharded_class(cls: type) -> type:
    found = _CLASS_CACHE.get(cls)
    if found is None:
        made = type(f"FSDP{cls.__name__}", (ShardedModule, cls), {"_plain_cls": cls})
        found = _CLASS_CACHE.setdefault(cls, made)
    return found


# [Note: placements name the checkpoint's split]
# FSDP2's `shard_placement_fn` picks, per parameter, the dim its shards are cut on (Shard(1) for a
# wide matrix, the largest dim, ...): there, the layout in memory, the state dict and DCP all
# follow it. Ours keeps every parameter in its unit's flat buffer whatever the placement (the
# gathers stay single copies into place, [Note: flat storage] in flat.py), so the placement
# names what the outside world sees: the model's and the optimizer's state dicts give the
# parameter as a Shard(d) DTensor over the shard dim (chunked as torch.chunk, as FSDP2's), and any
# placement loads back (a DTensor is taken whole). Training numerics do not depend on it.
def _placement_dim(fn: Callable, param: torch.Tensor, e: FlatEntry) -> int:
    placement = fn(param)
    name = e.users[0][2]
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement!r} for {name}; return Shard(dim) or None (Shard(0))"
        )
    ndim = len(e.shape)
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < max(ndim, 1) or ndim == 0:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement!r} for {name} of shape {tuple(e.shape)}; "
            f"give a dim in [-{ndim}, {ndim}) or None"
        )
    if e.tp is not None and dim != 0:
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn chose Shard({dim}) for the tensor parallel parameter {name}; "
            f"together with tensor parallelism only Shard(0) (or None) is supported"
        )
    return dim


def fully_shard(
    module: Union[nn.Module, List[nn.Module]],
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int] = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: Optional[OffloadPolicy] = None,
    comm_policy: Optional[QuantizedCommPolicy] = None,
    ignored_params: Optional[Set[nn.Parameter]] = None,
    shard_placement_fn: Optional[Callable] = None,
    shard_boundary: str = "anywhere",
) -> nn.Module:
    """Shard `module`'s parameters that no sub-unit owns yet into one unit (ZeRO-3 by default).

    module: one module, or a list of modules sharded together as one unit (FSDP2's grouping,
        e.g. torchtitan's [norm, output]): gathered when the first of them runs forward, freed
        (ZeRO-3) once all of them have; each becomes a sharded module. Returns what it was given.

    reshard_after_forward: True = free the gathered parameters after forward (ZeRO-3); False = keep
        them until backward ends (ZeRO-2); an int k = hpZ: keep a secondary shard over groups of k
        consecutive ranks after forward so backward all-gathers over k ranks only (k must divide the
        shard-group size; k equal to it means True, 1 means False).
    comm_policy: QuantizedCommPolicy for int8 all-gather / all-to-all gradient reduction (ZeRO++);
        `MixedPrecisionPolicy(quantized_comm=True)` is the same with the default block of 256.
    offload_policy: CPUOffloadPolicy() keeps shards, gradients and optimizer state on the host;
        OffloadPolicy() or None: no offloading.
    ignored_params: parameters the engine leaves alone (FSDP2's): not sharded, not gathered, their
        gradients not reduced; they stay plain, replicated parameters of the module.
    shard_placement_fn: FSDP2's per-parameter placement: called with each parameter, it returns
        `Shard(d)` or None (Shard(0)). Here it says how the parameter's checkpoint DTensors (the
        model's and the optimizer's state dicts) are split, `Shard(d)` over the shard dim, as
        FSDP2's are; the unit still holds it in its flat buffer, cut where `shard_boundary` lets
        ranks begin ([Note: placements name the checkpoint's split]). Not with tensor parallel.
    shard_boundary: where a rank's piece may begin or end ([Note: shard boundaries] in
        framework/distributed/shard_layout.py): "anywhere" (tight packing, the default), "rows"
        (each rank holds whole rows of every matrix) or "params" (each parameter whole on one
        rank). Checkpoints do not depend on it: one written under one policy loads under another.
    """
    if shard_boundary not in BOUNDARIES:
        raise ValueError(f"fully_shard: shard_boundary={shard_boundary!r}; choose one of {', '.join(BOUNDARIES)}")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(
            f"fully_shard: offload_policy={offload_policy!r}; give CPUOffloadPolicy(), OffloadPolicy() or None"
        )
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    ignored = {id(p) for p in (ignored_params or ())}
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    if not members or not all(isinstance(m, nn.Module) for m in members):
        raise ValueError(f"fully_shard: {module!r}; give a module or a non-empty list of modules")
    for m in members:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__} "
                "has none, so no forward would gather it; shard its members one by one "
                "(for layer in model.layers: fully_shard(layer)) or as one group (fully_shard(list(model.layers)))"
            )
        if getattr(m, "_fsdp_unit", None) is not None:
            raise ShardedTwiceError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard: {type(m).__name__} is already sharded; apply fully_shard once per module, bottom-up"
            )
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward!r}; use True, False or an int")
    if comm_policy is None and mp_policy.quantized_comm:
        comm_policy = QuantizedCommPolicy()
    if offload and comm_policy is not None:
        raise NotImplementedError(
            "fully_shard: CPUOffloadPolicy together with QuantizedCommPolicy is not supported; drop one"
        )
    # Collect the distinct parameters not owned by a sub-unit, with every (module, name) using them.
    by_id: Dict[int, FlatEntry] = {}
    params: Dict[int, torch.Tensor] = {}  # the values to shard (a DTensor's TP-local tensor)
    owners: Dict[int, nn.Parameter] = {}  # the registered parameter objects
    walk = [
        (k, name, mod) for k, member in enumerate(members) for name, mod in member.named_modules(remove_duplicate=False)
    ]
    for k, mod_name, mod in walk:
        for name, p in list(mod._parameters.items()):
            if p is None or owner_of(p) is not None or id(p) in ignored:
                continue
            claimed = claimed_by(p)
            if claimed is not None:
                raise ValueError(
                    f"fully_shard: parameter {mod_name}.{name} is tied to a parameter of the already-sharded "
                    f"{claimed}, which is used outside it; tied parameters must belong to one unit: shard "
                    f"the module that contains all their users (e.g. only the root) instead"
                )
            fqn = f"{mod_name}.{name}" if mod_name else name
            if id(p) not in by_id:
                tp, src = None, p
                if isinstance(p, DTensor):
                    if p.device_mesh.ndim != 1:
                        raise NotImplementedError(
                            f"fully_shard: parameter {fqn} is a DTensor on a {p.device_mesh.ndim}-D mesh; tensor "
                            f"parallel composition supports a 1-D tp mesh only"
                        )
                    tp = TPSpec(p.device_mesh, tuple(p.placements), p.shape, p.stride())
                    src = p._local_tensor
                by_id[id(p)] = FlatEntry(
                    users=[], shape=src.shape, offset=0, numel=src.numel(), requires_grad=p.requires_grad, tp=tp
                )
                params[id(p)] = src
                owners[id(p)] = p
            by_id[id(p)].users.append((mod, name, fqn))
            by_id[id(p)].members.append(k)
    entries = list(by_id.values())
    originals = [params[i] for i in by_id]
    if shard_placement_fn is not None:
        for e, i in zip(entries, by_id):
            e.state_dim = _placement_dim(shard_placement_fn, owners[i], e)
    if not entries:
        device = torch.device("cpu")
    else:
        device = originals[0].device
        dtypes = {p.dtype for p in originals}
        if len(dtypes) > 1:
            raise NotImplementedError(
                f"fully_shard: one unit with several parameter dtypes {dtypes} is not supported; cast the model first"
            )
    tp_meshes = {mesh_key(e.tp.mesh): e.tp.mesh for e in entries if e.tp is not None}
    if len(tp_meshes) > 1:
        raise NotImplementedError(
            "fully_shard: parameters on several tensor parallel meshes in one unit are not supported"
        )
    tp_mesh = next(iter(tp_meshes.values()), None)
    mesh, shard_group, replicate_group, tp_mesh = resolve_mesh(mesh, device, tp_mesh)
    n_shard = dist.get_world_size(shard_group)
    hpz = None
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        k = reshard_after_forward
        if k == n_shard:
            reshard_after_forward = True
        elif k == 1:
            reshard_after_forward = False
        elif 1 < k < n_shard and n_shard % k == 0:
            if comm_policy is not None or offload:
                raise NotImplementedError(
                    "fully_shard: reshard_after_forward=<int> (hpZ) together with QuantizedCommPolicy or "
                    "CPUOffloadPolicy is not supported; drop one"
                )
            hpz = secondary_group(mesh, k)
            reshard_after_forward = True
        else:
            raise ValueError(
                f"fully_shard: reshard_after_forward={k}: an int must divide the shard-group size {n_shard} "
                f"(hpZ: keep a secondary shard over groups of that many ranks after forward)"
            )
    align = comm_policy.align if comm_policy is not None else 1
    layout = build_layout(entries, n_shard, dist.get_rank(shard_group), align=align, boundary=shard_boundary)
    shard_dtype = originals[0].dtype if originals else torch.float32
    unit = ShardUnit(
        members[0],
        entries=entries,
        layout=layout,
        shard_group=shard_group,
        reduce_group=reduce_group(mesh, shard_group),
        replicate_group=replicate_group,
        mesh=mesh,
        reshard_after_forward=bool(reshard_after_forward),
        mp=mp_policy,
        offload=offload,
        comm=comm_policy,
        compute_device=device,
        shard_dtype=shard_dtype,
    )
    if hpz is not None:
        unit.codec.set_secondary(*hpz)
    if tp_mesh is not None:
        unit.tp_size = tp_mesh.size()
        if any(e.tp is not None for e in entries):
            unit.state_mesh = dp_tp_mesh(mesh, tp_mesh)
    # Copy this rank's slice of the original parameters into the shard buffer, then replace every
    # registration of each original parameter by its sharded piece (a view of the shard buffer).
    with torch.no_grad():
        for e, p in zip(entries, originals):
            if e.local_numel:
                unit.shard[layout.shard_slice(e)].copy_(p.detach().reshape(-1)[layout.piece_slice(e)])
    for i, (e, p) in enumerate(zip(entries, [owners[i] for i in by_id])):
        # [Note: pieces that describe themselves] in views.py
        sp = nn.Parameter(ShardPiece(unit.shard[layout.shard_slice(e)], piece_spec(unit, i)), e.requires_grad)
        unit.set_sharded_param(i, sp)  # [Note: records of sharded parameters] in unit.py
        for mod, name, _ in e.users:
            mod._parameters[name] = sp
        claim(p, f"{type(members[0]).__name__} unit")
        if not isinstance(p, DTensor):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # release the unsharded original
    unit.members = members if len(members) > 1 else None
    for k, m in enumerate(members):
        m._fsdp_unit = unit
        m.__class__ = _sharded_class(type(m))
        hooks.register(unit, m)
        register_state_dict_hooks(unit, m, k)
    return module


def _state(module: nn.Module):
    """FSDP2's `fully_shard.state(module)`: what the `fully_shard` call that took `module` made (our
    unit, unit.py's `ShardUnit`; the members of a group share one), None where none took it."""
    return getattr(module, "_fsdp_unit", None)


fully_shard.state = _state
