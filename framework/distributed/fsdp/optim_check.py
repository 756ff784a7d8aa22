"""What the optimizer sees of a sharded parameter, and the one grouping mistake that flat pieces invite.

[Note: grouping optimizer parameters by ndim]
The optimizer's parameters are 1-D local pieces (see docs/engine.md, "The optimizer sees flat
slices"), so code that picks weight decay by `p.dim() >= 2` (nanoGPT's `configure_optimizers`,
and many scripts written after it) puts every sharded matrix in the no-decay group: silently, no
weight decay anywhere. `original_shape(p)` gives the shape the model computes with; and on the
first step of each optimizer a global step pre-hook (torch's public
`register_optimizer_step_pre_hook`, installed by `fully_shard`) refuses the tell-tale layout: the
groups with weight decay are empty (or hold no sharded piece, one empty) while a group without
decay holds sharded matrices. The check runs once per optimizer; later steps cost one lookup.
The same first step registers the optimizer's state-dict hooks ([Note: the optimizer's own
state_dict holds DTensors] in state_dict.py).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from .unit import owner_of

_CHECKED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_INSTALLED: list = []


def original_shape(param: torch.Tensor) -> Optional[torch.Size]:
    """The shape `param` has in the model (the full, unsharded shape; under tensor parallel the
    global one) when our engine sharded it, None for any other tensor. Group optimizer parameters
    by this (or by name), never by the 1-D piece's own `ndim`."""
    owner = owner_of(param)
    if owner is None:
        return None
    unit, index = owner
    return unit.entries[index].global_shape


def _name(param: torch.Tensor) -> str:
    unit, index = owner_of(param)
    return f"{unit.name}.{unit.entries[index].users[0][2]}".lstrip(".")


def check_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """Refuse decay groups built by `ndim` over our parameters (see the note at the top)."""
    undecayed = []
    empty_decay_group = False
    for group in optimizer.param_groups:
        decay = float(group.get("weight_decay", 0.0) or 0.0)
        if decay > 0:
            empty_decay_group = empty_decay_group or not group["params"]
            if any(original_shape(p) is not None for p in group["params"]):
                return  # some sharded piece is decayed: grouped by something other than ndim
        else:
            undecayed += [p for p in group["params"] if len(original_shape(p) or ()) >= 2]
    if empty_decay_group and undecayed:
        example = undecayed[0]
        raise ValueError(
            f"optimizer: every sharded matrix (e.g. {_name(example)}, shape {tuple(original_shape(example))}) is in "
            "a parameter group without weight decay while a group with weight decay holds none: the engine's "
            "parameters are 1-D local pieces, so grouping by p.dim()/p.ndim puts every one in the no-decay group. "
            "Group by name, or by framework.distributed.fsdp.original_shape(p)"
        )


def _pre_step(optimizer, args, kwargs) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    check_param_groups(optimizer)
    if any(original_shape(p) is not None for g in optimizer.param_groups for p in g["params"]):
        from .state_dict import hook_optimizer_state_dict  # [Note: the optimizer's own state_dict holds DTensors]

        hook_optimizer_state_dict(optimizer)


def install_param_group_check() -> None:
    """Register the step pre-hook once per process; called by `fully_shard`."""
    if not _INSTALLED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _INSTALLED.append(register_optimizer_step_pre_hook(_pre_step))
