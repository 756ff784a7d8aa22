"""The methods every module `fully_shard` was applied to gains: FSDP2's `FSDPModule` API, and ours.

`fully_shard` swaps a module's class for a subclass of `ShardedModule` (so
`isinstance(m, FSDPModule)` holds, as in FSDP2). The `set_*` methods that take `recurse` apply to
the units at and below the module (its own and those of sharded submodules). Where the flat
layout makes an FSDP2 behaviour impossible, the method refuses by name (docs/engine.md, "Where it
differs from FSDP2").
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn as nn

from . import hooks
from .unit import ShardUnit, sharded_units


class UnshardHandle:
    """What `unshard(async_op=True)` returns: `wait()` blocks until the module's parameters are
    gathered and exposed (FSDP2's handle)."""

    def __init__(self, units: List[ShardUnit]) -> None:
        self._units = units

    def wait(self) -> None:
        for u in self._units:
            u.wait_unshard()
        self._units = []


class ShardedModule:
    """Methods added to every module that `fully_shard` was applied to (FSDP2's `FSDPModule`)."""

    # [Note: only the sharded module itself is sharded]
    # `fully_shard` swaps the class of the module it is given (fully_shard.py's `_sharded_class`);
    # a new instance made through that class is not sharded by anything, so constructing one gives
    # the module's own class: slicing a sharded `nn.Sequential` (`model[:2]`, which calls
    # `self.__class__(...)`) gives a plain `nn.Sequential`, as under FSDP2. A deep copy would copy
    # the unit's buffers and hooks half-way (a piece cannot be deep-copied alone) and is refused
    # with FSDP2's words and exception type, which code written for FSDP2 checks.
    def __new__(cls, *args, **kwargs):
        plain = cls.__dict__.get("_plain_cls")
        if plain is None:  # ShardedModule itself, or a class a user derived from a sharded one
            return super().__new__(cls)
        module = plain.__new__(plain)
        module.__init__(*args, **kwargs)  # not called by Python: the result is not a `cls`
        return module

    def __deepcopy__(self, memo):
        raise AssertionError(
            f"FSDP does not support deepcopy: {type(self).__name__} is sharded; deep-copy the model before "
            "fully_shard, or build a new one and load this one's state_dict()"
        )

    def _units(self) -> List[ShardUnit]:
        return sharded_units(self)

    def _chosen(self, recurse: bool) -> List[ShardUnit]:
        return self._units() if recurse else [self._fsdp_unit]

    # ---------------------------------------------------------------- gradient synchronisation
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False for gradient-accumulation micro-steps: gradients accumulate unsharded, no communication."""
        for u in self._chosen(recurse):
            u.reduction.requires_grad_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """Hybrid sharding: False skips the all-reduce over the replicas after the reduce-scatter
        (the reduce-scattered gradients accumulate on each replica until a backward with True)."""
        for u in self._chosen(recurse):
            u.reduction.requires_all_reduce = requires_all_reduce

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility, with no effect: every backward of ours waits for its
        reductions in the root's final callback, so there is nothing to defer (FSDP2 uses it to
        skip waiting between micro-batches of pipeline schedules)."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by `factor` instead of the data-parallel size (e.g. 1.0 for
        a sum; FSDP2's `set_gradient_divide_factor`). Applies to this module's units and below."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor={factor}; give a positive number")
        for u in self._units():
            u.reduction.divide_factor = float(factor)

    def set_norm_copies(self, copies: int) -> None:
        """This module's parameters are held identically by `copies` groups of ranks that its mesh
        does not name (expert parallelism's experts, whole on every tensor-parallel rank):
        gradient clipping counts each piece once. Applies to this module's units and below."""
        if copies < 1:
            raise ValueError(f"set_norm_copies: copies={copies}; give a positive count")
        for u in self._units():
            u.set_outer_copies(copies)

    def set_deterministic_reduction(self, enabled: bool = True) -> None:
        """Sum gradients in the fixed tree of [Note: one summation tree, whatever the layout]
        (canonical.py): each backward is one leaf (a unit of the global batch, in the global data
        order: the caller runs them in that order, this rank's units being consecutive), the
        reduction an all-to-all whose receivers add in tree order. Gradients are summed, never
        divided (the loss carries its global normalisation). Applies to this module's units and below."""
        for u in self._units():
            u.reduction.deterministic = bool(enabled)
            u.reduction.divide_factor = 1.0 if enabled else None
            u.reduction.drop_accumulated()

    def backward_in_parts(self):
        """A context manager (on the root): the autograd calls made inside it are the parts of
        one backward of this model, e.g. a pipeline's weight-gradient pass run as one call per
        group of weights. The units are gathered first where a forward freed them, and the final
        callback (the reductions drained, the units resharded or kept as set) runs once, when the
        block ends. See [Note: one backward in several autograd calls] in context.py."""
        ctx = self._fsdp_unit.ctx
        assert ctx is not None, f"backward_in_parts on {type(self).__name__} before its first forward"
        return ctx.backward_in_parts()

    # ---------------------------------------------------------------- when parameters are gathered
    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """True frees the gathered parameters after forward (ZeRO-3), False keeps them until
        backward ends (ZeRO-2). Also for the root, which otherwise stays gathered after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"set_reshard_after_forward: {reshard_after_forward!r}; give True or False (hpZ, an int, is "
                "chosen once in fully_shard)"
            )
        for u in self._chosen(recurse):
            u.reshard_after_forward = reshard_after_forward
            u.reshard_after_forward_set = True

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the gathered parameters after backward (a following forward, e.g. the next
        gradient-accumulation micro-batch, then needs no all-gather); `reshard()` frees them."""
        for u in self._chosen(recurse):
            u.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's unit is not gathered again in backward (FSDP2's, for modules whose
        backward does not read their parameters, e.g. an embedding: its weight's gradient needs
        only the indices). Its gradients are still reduced, from a pooled buffer instead of the
        gathered storage ([Note: a unit not gathered in backward] in reduce.py). A module whose
        backward does read its parameters must keep True: it would read released storage."""
        if not isinstance(unshard_in_backward, bool):
            raise ValueError(f"set_unshard_in_backward: {unshard_in_backward!r}; give True or False")
        self._fsdp_unit.unshard_in_backward = unshard_in_backward

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this module's parameters now (FSDP2's `unshard`): with `async_op=True` the
        all-gather is issued and a handle returned, whose `wait()` exposes the parameters; the
        next forward then needs no gather. Collective over the module's shard group."""
        unit = self._fsdp_unit
        unit.unshard()
        handle = UnshardHandle([unit])
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters (only the shards stay)."""
        self._fsdp_unit.reshard()

    def reset_iter_state(self) -> None:
        """After an exception in the middle of a step: finish what is in flight, free every gathered
        parameter and return the model to the start of a step (FSDP2's `reset_iter_state`)."""
        ctx = self._fsdp_unit.ctx
        if ctx is not None:
            ctx.reset_iter_state()

    def set_modules_to_forward_prefetch(self, modules: List[nn.Module]) -> None:
        """Gather these sharded modules' parameters (async) when this module's forward starts,
        instead of the next unit of the recorded forward order (FSDP2's explicit prefetching)."""
        self._fsdp_unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List[nn.Module]) -> None:
        """Gather these sharded modules' parameters (async) when this module's backward starts,
        instead of the previous unit of the recorded forward order."""
        self._fsdp_unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    # ---------------------------------------------------------------- ours
    def comm_stats(self) -> dict:
        """Communication since `reset_comm_stats()`, summed over the units at and below this module;
        and the whole-matrix transforms' work ([Note: whole matrices from pieces] in whole.py):
        `whole_matrix_flops` this rank's, `whole_matrix_max_over_ideal` the busiest rank's over the
        mean (the largest of the calls; 0.0 when none ran)."""
        keys = (
            "allgather_bytes",
            "reduce_scatter_bytes",
            "allreduce_bytes",
            "alltoall_bytes",
            "num_collectives",
            "exposed_comm_s",
            "whole_matrix_flops",
        )
        out = {k: 0 for k in keys}
        out["whole_matrix_max_over_ideal"] = 0.0
        for u in self._units():
            u.stats.resolve()  # CUDA: read the timed waits (see collectives.wait)
            for k in keys:
                out[k] += getattr(u.stats, k)
            ratio = u.stats.whole_matrix_max_over_ideal
            out["whole_matrix_max_over_ideal"] = max(out["whole_matrix_max_over_ideal"], ratio)
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
        # `.to(device)`, `.to_empty(device=...)`, `.double()` replace the parameters' data (by
        # assigning `.data`, or by `torch.utils.swap_tensors` where torch.__future__ asks for it:
        # the pieces carry their description either way, [Note: records of sharded parameters]);
        # the children (their own units) rebind in their own _apply, this unit after its parameters.
        result = super()._apply(fn, recurse)
        self._fsdp_unit.rebind_after_apply(fn)
        hooks.register_param_hooks(self._fsdp_unit)
        return result


FSDPModule = ShardedModule  # FSDP2's name, for isinstance checks written against torch's API


def _units_of(modules: List[nn.Module], what: str) -> List[ShardUnit]:
    units = []
    for m in modules:
        if getattr(m, "_fsdp_unit", None) is None:
            raise ValueError(f"{what}: {type(m).__name__} is not sharded; pass modules that fully_shard was applied to")
        units.append(m._fsdp_unit)
    return units


def register_fsdp_forward_method(module: nn.Module, method_name: str, *, gather_once: bool = False) -> None:
    """Make `module.<method_name>` gather and free the module's parameters as `forward` does
    (FSDP2's function of this name): e.g. `generate` on a sharded model. Forwards the method
    calls inside it (`self(...)`) run without hooks of their own for this module.

    Ours: `gather_once=True` (for methods run under `torch.no_grad`, e.g. token-by-token decoding)
    gathers every unit at and below the module when the method starts and frees them all when it
    returns; the forwards inside run without any unit's hooks, so they gather nothing (FSDP2's
    inner forwards gather each block at every call). It holds the whole model gathered for the call."""
    unit = getattr(module, "_fsdp_unit", None)
    if unit is None:
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not sharded; apply fully_shard to it first"
        )
    method = getattr(module, method_name)

    def run(*args, **kwargs):
        if unit.in_method:  # a nested call (generate calling generate): the outer one gathered
            return method(*args, **kwargs)
        if gather_once and torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(module).__name__}.{method_name} was registered with gather_once=True, which runs its "
                "forwards without the backward's hooks: call it under torch.no_grad()"
            )
        changed = hooks.pre_forward(unit, module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        held = sharded_units(module) if gather_once else [unit]
        for u in held:  # issue every gather, then wait for them in order
            u.unshard()
        for u in held:
            u.wait_unshard()
            u.in_method = True
        try:
            out = method(*args, **kwargs)
        finally:
            for u in held:
                u.in_method = False
        out = hooks.post_forward(unit, module, args, kwargs, out)
        if gather_once:
            for u in held:
                u.reshard()
        return out

    setattr(module, method_name, run)
