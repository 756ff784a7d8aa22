"""`fully_shard(module, ...)`: turn a module's not-yet-owned parameters into one sharded unit.

Applied bottom-up (each block, then the root), like FSDP2. The module's class is swapped for a
subclass that adds the FSDP2-style methods (`set_requires_gradient_sync`, `reshard`, `unshard`,
`set_modules_to_forward_prefetch`, `set_modules_to_backward_prefetch`) and ours (`comm_stats`,
`reset_comm_stats`, `sharded_tensor_bytes`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import hooks
from .api import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedCommPolicy
from .clip import install_torch_norm
from .flat import FlatEntry, TPSpec, build_layout
from .mesh import dp_tp_mesh, mesh_key, reduce_group, resolve_mesh, secondary_group
from .optim_check import install_param_group_check
from .state_dict import register_state_dict_hooks
from .unit import ShardUnit, claim, claimed_by, owner_of, sharded_units


class ShardedModule:
    """Methods added to every module that `fully_shard` was applied to."""

    def _units(self) -> List[ShardUnit]:
        return sharded_units(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False for gradient-accumulation micro-steps: gradients accumulate unsharded, no communication."""
        for u in self._units() if recurse else [self._fsdp_unit]:
            u.requires_grad_sync = requires_gradient_sync

    def comm_stats(self) -> dict:
        """Communication since `reset_comm_stats()`, summed over the units at and below this module."""
        keys = (
            "allgather_bytes",
            "reduce_scatter_bytes",
            "allreduce_bytes",
            "alltoall_bytes",
            "num_collectives",
            "exposed_comm_s",
        )
        out = {k: 0 for k in keys}
        for u in self._units():
            u.stats.resolve()  # CUDA: read the timed waits (see collectives.wait)
            for k in keys:
                out[k] += getattr(u.stats, k)
        return out

    def reset_comm_stats(self) -> None:
        for u in self._units():
            u.stats.reset()

    def sharded_tensor_bytes(self) -> dict:
        """Bytes the engine holds on this rank: per unit its shard, grad shard, unsharded storage,
        accumulation buffer, hpZ secondary shard and send buffer; once for the model its pooled
        buffers (gradient inputs and outputs, reduce-scatter scratch, int8 receive buffers).
        `total` is their sum: everything the engine holds besides the optimizer's state."""
        out: dict = {}
        for u in self._units():
            for k, v in u.tensor_bytes().items():
                out[k] = out.get(k, 0) + v
        ctx = self._fsdp_unit.ctx
        out["grad_pool"] = ctx.pool_bytes() if ctx is not None else 0
        out["total"] = sum(out.values())
        return out

    def _apply(self, fn, recurse=True):
        # `.to(device)`, `.to_empty(device=...)`, `.double()` replace the parameters' data; the
        # children (their own units) rebind in their own _apply, this unit after its parameters.
        result = super()._apply(fn, recurse)
        self._fsdp_unit.rebind_after_apply(fn)
        hooks.register_param_hooks(self._fsdp_unit)
        return result

    def set_modules_to_forward_prefetch(self, modules: List[nn.Module]) -> None:
        """Gather these sharded modules' parameters (async) when this module's forward starts,
        instead of the next unit of the recorded forward order (FSDP2's explicit prefetching)."""
        self._fsdp_unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List[nn.Module]) -> None:
        """Gather these sharded modules' parameters (async) when this module's backward starts,
        instead of the previous unit of the recorded forward order."""
        self._fsdp_unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def unshard(self) -> None:
        self._fsdp_unit.wait_unshard()

    def reshard(self) -> None:
        self._fsdp_unit.reshard()


def _units_of(modules: List[nn.Module], what: str) -> List[ShardUnit]:
    units = []
    for m in modules:
        if getattr(m, "_fsdp_unit", None) is None:
            raise ValueError(f"{what}: {type(m).__name__} is not sharded; pass modules that fully_shard was applied to")
        units.append(m._fsdp_unit)
    return units


_CLASS_CACHE: Dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return _CLASS_CACHE[cls]


def fully_shard(
    module: nn.Module,
    *,
    mesh: Optional[DeviceMesh] = None,
    reshard_after_forward: Union[bool, int] = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: Optional[CPUOffloadPolicy] = None,
    comm_policy: Optional[QuantizedCommPolicy] = None,
) -> nn.Module:
    """Shard `module`'s parameters that no sub-unit owns yet into one unit (ZeRO-3 by default).

    reshard_after_forward: True = free the gathered parameters after forward (ZeRO-3); False = keep
        them until backward ends (ZeRO-2); an int k = hpZ: keep a secondary shard over groups of k
        consecutive ranks after forward so backward all-gathers over k ranks only (k must divide the
        shard-group size; k equal to it means True, 1 means False).
    comm_policy: QuantizedCommPolicy for int8 all-gather / all-to-all gradient reduction (ZeRO++);
        `MixedPrecisionPolicy(quantized_comm=True)` is the same with the default block of 256.
    """
    install_torch_norm()  # [Note: torch's clip_grad_norm_ on sharded parameters] in clip.py
    install_param_group_check()  # [Note: grouping optimizer parameters by ndim] in optim_check.py
    if getattr(module, "_fsdp_unit", None) is not None:
        raise ValueError(
            f"fully_shard: {type(module).__name__} is already sharded; apply fully_shard once per module, bottom-up"
        )
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward!r}; use True, False or an int")
    if comm_policy is None and mp_policy.quantized_comm:
        comm_policy = QuantizedCommPolicy()
    if offload_policy is not None and comm_policy is not None:
        raise NotImplementedError(
            "fully_shard: CPUOffloadPolicy together with QuantizedCommPolicy is not supported; drop one"
        )
    # Collect the distinct parameters not owned by a sub-unit, with every (module, name) using them.
    by_id: Dict[int, FlatEntry] = {}
    params: Dict[int, torch.Tensor] = {}  # the values to shard (a DTensor's TP-local tensor)
    owners: Dict[int, nn.Parameter] = {}  # the registered parameter objects
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is None or owner_of(p) is not None:
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
    entries = list(by_id.values())
    originals = [params[i] for i in by_id]
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
            if comm_policy is not None or offload_policy is not None:
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
    align = comm_policy.block_size if comm_policy is not None else 1
    layout = build_layout(entries, n_shard, dist.get_rank(shard_group), align=align)
    shard_dtype = originals[0].dtype if originals else torch.float32
    unit = ShardUnit(
        module,
        entries=entries,
        layout=layout,
        shard_group=shard_group,
        reduce_group=reduce_group(mesh, shard_group),
        replicate_group=replicate_group,
        mesh=mesh,
        reshard_after_forward=bool(reshard_after_forward),
        mp=mp_policy,
        offload=offload_policy is not None,
        comm=comm_policy,
        compute_device=device,
        shard_dtype=shard_dtype,
    )
    if hpz is not None:
        unit.set_secondary(*hpz)
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
        sp = nn.Parameter(unit.shard[layout.shard_slice(e)], requires_grad=e.requires_grad)
        unit.set_sharded_param(i, sp)  # [Note: records of sharded parameters] in unit.py
        for mod, name, _ in e.users:
            mod._parameters[name] = sp
        claim(p, f"{type(module).__name__} unit")
        if not isinstance(p, DTensor):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # release the unsharded original
    module._fsdp_unit = unit
    module.__class__ = _sharded_class(type(module))
    hooks.register(unit)
    register_state_dict_hooks(unit)
    return module
