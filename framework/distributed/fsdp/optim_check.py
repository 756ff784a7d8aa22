"""What the optimizer sees of a sharded parameter, and the one grouping mistake that flat pieces invite.

[Note: grouping optimizer parameters by ndim]
The optimizer's parameters are 1-D local pieces (see docs/engine.md, "The optimizer sees flat
slices"), so code that picks weight decay by `p.dim() >= 2` (nanoGPT's `configure_optimizers`,
and many scripts written after it) puts every sharded matrix in the no-decay group: silently, no
weight decay anywhere. `original_shape(p)` (or `p.piece_spec.full_shape`) gives the shape the model computes with.
`prepare_optimizer(optimizer)`, an explicit opt-in (the engine changes nothing of torch's for the
whole process, so it cannot see optimizers it was not given), refuses the tell-tale layout: the
groups with weight decay are empty (or hold no sharded piece, one empty) while a group without
decay holds sharded matrices; and it registers the optimizer's state-dict hooks ([Note: the
optimizer's own state_dict holds DTensors] in state_dict.py), so that `optimizer.state_dict()`,
torch's `get_optimizer_state_dict` and DCP see per-parameter Shard(0) DTensors.

[Note: the optimizer step on plain local data]
Every torch op on a `ShardPiece` costs one Python `__torch_function__` call (~2 us), and an
out-of-place result is wrapped as a piece (~5 us more): for torch's for-loop AdamW, some fifteen
calls per parameter, which made the step 1.12x slower than on plain tensors (bench/RESULTS.md).
What the pieces buy inside a step is only their norms (a partial norm completed over the ranks)
and the description of the state the step creates. An optimizer whose update is elementwise
(torch's AdamW, Adam and SGD by exact type, or a class that says `elementwise_step = True`) takes
no norm, so once every parameter that has a gradient has its state (made as pieces on the step
that first saw it), `optimizer_step(opt)` runs `opt.step()` with the subclass's
`__torch_function__` switched off for that call (`torch._C.DisableTorchFunctionSubclass`, a
thread-local switch restored when the call ends, also by an exception): the same arithmetic on the
same storage, bit for bit, with no Python per op; the parameters, gradients and state stay the
pieces they were (in-place updates). Any other optimizer, a subclass of those (it may take a
norm), or a step that will create state (a parameter's first gradient) runs as `opt.step()`. The
trainer steps through it; a user's own loop may call it or `opt.step()`, with the same result.
"""

from __future__ import annotations

from typing import Optional

import torch

from .unit import owner_of


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


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Opt an optimizer over our sharded parameters into the engine's checks and state-dict
    format (see the note at the top); returns it. Idempotent; a no-op for an optimizer that holds
    no sharded parameter."""
    if any(original_shape(p) is not None for g in optimizer.param_groups for p in g["params"]):
        check_param_groups(optimizer)
        from .state_dict import hook_optimizer_state_dict  # [Note: the optimizer's own state_dict holds DTensors]

        hook_optimizer_state_dict(optimizer)
    return optimizer


_ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


def _elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in _ELEMENTWISE or type(optimizer).__dict__.get("elementwise_step") is True


def _state_made(optimizer: torch.optim.Optimizer) -> bool:
    """Every parameter with a gradient has its optimizer state (called with the subclass's
    `__torch_function__` off: `.grad` and hashing a piece are Python calls otherwise)."""
    state = optimizer.state
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not state.get(p):
                return False
    return True


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, on the plain local data when that is the same computation: see
    [Note: the optimizer step on plain local data]."""
    if _elementwise(optimizer):
        with torch._C.DisableTorchFunctionSubclass():
            if _state_made(optimizer):
                optimizer.step()
                return
    optimizer.step()
