"""Module and autograd hooks that drive the units through a training step.

forward pre-hook   : (root) lazy init, phase FORWARD; wait for this unit's gather, prefetch the
                     next unit's gather (order recorded on the first step), cast inputs.
forward post-hook  : reshard (ZeRO-3) or keep (ZeRO-2, root); hook the outputs for pre-backward.
pre-backward       : (a grad hook on the unit's outputs) re-gather, prefetch the unit backward
                     reaches next (reverse forward order); the root queues the final callback.
post-accumulate    : per full parameter; the unit's last one issues the reduce-scatter and
                     reshards, so the reduce-scatter overlaps the backward of earlier units.
final callback     : ShardContext.finish_backward: wait for all reductions before optimizer.step().
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, List, Optional

import torch
import torch.nn as nn
from torch.profiler import record_function

from .api import TrainingPhase, UnitState
from .context import ShardContext
from .unit import ShardUnit, sharded_units


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # NamedTuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # a copy with every init field mapped (FSDP2 casts dataclass inputs and hooks their outputs too)
        fields = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


def _tensors(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    _map_tensors(obj, lambda t: out.append(t) or t)
    return out


def _labelled(name: str) -> Callable:
    """Run the hook under a profiler label, so a trace reads by engine phase (as FSDP2's does),
    and always eagerly: a compiled module (`module.compile()`, `parallelism.compile=true`) calls
    its hooks from the compiled `_call_impl`, and tracing the engine's bookkeeping (collectives,
    clocks, unit state) broke the graph with warnings and recompiled it on every state change;
    FSDP2 keeps its hooks out of the compiler in the same way."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        return torch.compiler.disable(run)

    return wrap


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's forward inputs; its backward runs once everything the unit computed
    from them has run backward. See [Note: frozen parameters reshard after the unit's whole
    backward] in reduce.py."""

    @staticmethod
    def forward(ctx, unit: ShardUnit, *tensors: torch.Tensor):
        ctx.unit = unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        with record_function("fsdp::post_backward"):
            ctx.unit.reduction.post_backward()
        return (None, *grads)


def _hook_post_backward(unit: ShardUnit, args: tuple, kwargs: dict):
    """(args, kwargs) with the inputs that need a gradient passed through _PostBackward; None
    when no input needs one (the final callback reshards the unit then)."""
    needs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    if not needs:
        return None
    outs = _PostBackward.apply(unit, *needs)
    swap = {id(t): o for t, o in zip(needs, outs)}
    unit.reduction.note_forward_use()
    return _map_tensors((args, kwargs), lambda t: swap.get(id(t), t))


def _lazy_init(unit: ShardUnit) -> None:
    """The first unit to run forward without a context is the root of its model."""
    units = sharded_units(unit.module)
    for u in units:
        assert u.ctx is None, (
            f"[rank {u.rank}] unit {u.name} already belongs to a sharded model rooted at "
            f"{u.ctx.root.name}; call forward on the root module"
        )
    if not unit.reshard_after_forward_set:  # set_reshard_after_forward on the root wins
        unit.reshard_after_forward = False  # backward needs the root first; keep it (as FSDP2 does)
    ShardContext(unit, units)


@_labelled("fsdp::pre_forward")
def pre_forward(unit: ShardUnit, module: nn.Module, args: tuple, kwargs: dict):
    if unit.in_method:  # a forward inside a registered forward method: that method's hooks gathered
        return None
    if unit.ctx is None:
        _lazy_init(unit)
    ctx = unit.ctx
    if ctx.phase == TrainingPhase.PRE_BACKWARD:
        # Recomputation under activation checkpointing: the unit is already gathered for backward;
        # no prefetch, no phase change, and post_forward must not reshard.
        unit.wait_unshard()
        return None
    moved = False
    # A group (fully_shard([m1, m2])): its first member's forward of this pass gathers and
    # prefetches; the others find it gathered. See [Note: a group of modules is one unit].
    later_member = unit.members is not None and bool(unit.members_run)
    if unit.members is not None:
        unit.members_run.add(id(module))
    ctx.begin_forward(unit)  # decides whether it runs on its own (no prefetch)
    if later_member:
        unit.wait_unshard()
    elif unit is ctx.root:
        if ctx.phase == TrainingPhase.IDLE:  # a step starts: see [Note: requires_grad is read at every step]
            if [u for u in ctx.units if u.sync_requires_grad()]:  # every unit, no short-circuit
                for u in ctx.units:
                    register_param_hooks(u)
                ctx.trainable_changed()
        ctx.set_phase(TrainingPhase.FORWARD)
        # The root moves host inputs to the model's accelerator (FSDP2 does); the model's device is
        # that of its first unit with parameters (an empty root has none of its own).
        dev = next((u.compute_device for u in ctx.units if u.entries), unit.compute_device)
        if dev.type != "cpu" and any(t.device != dev for t in _tensors((args, kwargs))):
            args, kwargs = _map_tensors((args, kwargs), lambda t: t.to(dev, non_blocking=True))
            moved = True
    if not later_member:
        _gather_and_prefetch(unit, ctx)
    if torch.is_grad_enabled():
        ctx.note_forward(unit)
        if unit.has_frozen:
            hooked = _hook_post_backward(unit, args, kwargs)
            if hooked is not None:
                args, kwargs = hooked
                moved = True
    if unit.mp.param_dtype is not None and unit.mp.cast_forward_inputs:
        dt = unit.mp.param_dtype
        cast = lambda t: t.to(dt) if torch.is_floating_point(t) else t
        return _map_tensors(args, cast), _map_tensors(kwargs, cast)
    return (args, kwargs) if moved else None


def _gather_and_prefetch(unit: ShardUnit, ctx: ShardContext) -> None:
    ctx.record_order(unit)
    # Issue this unit's gather (if no prefetch did), then the next unit's, and only then wait:
    # the next gather overlaps this unit's wait and compute.
    unit.unshard()
    if unit.forward_prefetch is not None:  # set_modules_to_forward_prefetch replaces the implicit order
        for other in unit.forward_prefetch:
            other.unshard()
    elif ctx.order_frozen and not unit.standalone:
        i = ctx.order.index(unit) if unit in ctx.order else -1
        if 0 <= i < len(ctx.order) - 1:
            ctx.order[i + 1].unshard()
    unit.wait_unshard()


@_labelled("fsdp::post_forward")
def post_forward(unit: ShardUnit, module: nn.Module, args: tuple, kwargs: dict, output: Any):
    if unit.in_method:
        return output
    ctx = unit.ctx
    if ctx.phase == TrainingPhase.PRE_BACKWARD:  # recomputation, see pre_forward
        return output
    grad = torch.is_grad_enabled()
    if unit.members is not None and len(unit.members_run) < len(unit.members):
        pass  # a group frees its parameters once every member has run forward
    elif unit is ctx.root:
        ctx.end_root_forward(grad)
        if not grad:
            ctx.reshard_all()
            ctx.set_phase(TrainingPhase.IDLE)
        else:
            _complete_groups(ctx)
            if unit.reshard_after_forward:  # only when set_reshard_after_forward asked it of the root
                unit.reshard_after_forward_step()
    elif not grad:
        unit.reshard()
    elif unit.reshard_after_forward:
        unit.reshard_after_forward_step()
    if unit.members is not None and len(unit.members_run) == len(unit.members):
        unit.members_run.clear()
    if grad:
        member = module if unit.members is not None else None  # which member's outputs backward reached
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(lambda g, u=unit, m=member: _pre_backward(u, g, m))
    if unit.mp.output_dtype is not None:
        dt = unit.mp.output_dtype
        output = _map_tensors(output, lambda t: t.to(dt) if torch.is_floating_point(t) else t)
    return output


def _complete_groups(ctx: ShardContext) -> None:
    """At the end of the root's forward: finish the forward of every group some of whose members
    did not run in it (free it under ZeRO-3), as FSDP2 does; see [Note: a group of modules is one
    unit] in unit.py."""
    for u in ctx.units:
        if u.members is not None and u.members_run and u is not ctx.root:
            if u.reshard_after_forward:
                u.reshard_after_forward_step()
            u.members_run.clear()


@_labelled("fsdp::pre_backward")
def _pre_backward(unit: ShardUnit, grad: torch.Tensor, member: Optional[nn.Module] = None) -> None:
    ctx = unit.ctx
    ctx.backward_reached(unit, member)
    if ctx.backward_finished(unit):
        return  # a late hook on an output whose unit already finished its backward
    if unit.unshard_in_backward:
        unit.unshard()
    if unit.backward_prefetch is not None:  # set_modules_to_backward_prefetch replaces the implicit order
        for other in unit.backward_prefetch:
            if other.state == UnitState.SHARDED and not other.reduction.reduce_issued and other.unshard_in_backward:
                other.unshard()
    elif not unit.standalone:
        i = ctx.order.index(unit) if unit in ctx.order else -1
        prev = ctx.order[i - 1] if i > 0 else None
        if unit is ctx.root and ctx.order and ctx.order[-1] is not unit:
            # backward starts at the root's outputs (e.g. the loss head) and reaches the unit that
            # ran forward last next: gather it now, under the root's own backward compute
            prev = ctx.order[-1]
        waiting = prev is not None and prev.state == UnitState.SHARDED and ctx.awaiting_backward(prev)
        if waiting and prev.unshard_in_backward:
            prev.unshard()
    if unit.unshard_in_backward:
        unit.wait_unshard()


@_labelled("fsdp::post_accumulate_grad")
def post_accumulate_grad(unit: ShardUnit, full: torch.Tensor) -> None:
    if unit.unshard_in_backward:
        unit.assert_state(UnitState.UNSHARDED, what="post-accumulate-grad")
    unit.reduction.on_grad()


def register(unit: ShardUnit, module: nn.Module) -> None:
    """The forward hooks on `module` (the unit's, or one member of its group) and, once per unit,
    the gradient hooks."""
    module.register_forward_pre_hook(lambda m, a, k, u=unit: pre_forward(u, m, a, k), prepend=True, with_kwargs=True)
    module.register_forward_hook(lambda m, a, k, o, u=unit: post_forward(u, m, a, k, o), with_kwargs=True)
    register_param_hooks(unit)


def register_param_hooks(unit: ShardUnit) -> None:
    """Gradient hooks on the unit's (persistent) unsharded parameters that are trainable and have
    none yet (a parameter unfrozen after sharding gets its hooks here, at its first step)."""
    for i, (e, full) in enumerate(zip(unit.entries, unit.full_params)):
        if e.requires_grad and i not in unit.hooked:
            full.register_hook(lambda g, u=unit, i=i: u.reduction.pre_accumulate(i, g))
            full.register_post_accumulate_grad_hook(lambda t, u=unit: post_accumulate_grad(u, t))
            unit.hooked.add(i)
