"""Tensor parallelism with torch's DTensor styles: the generic applier and the loss around it.

    apply_tensor_parallel(model, mesh["tp"], cfg)    # once, before activation checkpointing / sharding
    with loss_context(model):                        # forward loss AND backward
        loss = cross_entropy(model(x), y); loss.backward()
    full(loss)                                        # a plain tensor whatever the layout

Each model family keeps its plan next to its definition, as `tp_plan(model, sequence_parallel)`
(the Llama one: `framework/models/llama/parallelize.py`), and registers it in the model registry;
the caller passes it in, so this module never imports a model.

[Note: the logits stay sharded on the vocabulary]
The output head leaves its logits as a DTensor sharded on the last dim. Cross-entropy on it runs
under `torch.distributed.tensor.parallel.loss_parallel`, which computes the log-softmax from
per-rank maxima and sums (two small all-reduces over (batch, seq)) instead of gathering
(batch, seq, vocab). The context must also cover `backward()`, whose first op is that loss's
gradient. Anything that wants plain logits (sampling, tools) calls `full`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from framework.errors import UserInputError

__all__ = ["apply_tensor_parallel", "loss_context", "full", "is_tensor_parallel"]

_TP_ATTR = "_framework_tp_degree"


def _tied_names(model: nn.Module) -> List[List[str]]:
    """Groups of parameter names that share one tensor (e.g. tied embedding and output head)."""
    by_id: Dict[int, List[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _set_param(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, leaf, param)


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, cfg, plan_fn: Optional[Callable[[nn.Module, bool], Dict]]
) -> nn.Module:
    """Split `model`'s layers over the 1-D `tp_mesh` by its family's plan (`plan_fn`, the
    registry's `tp_plan`: (model, sequence_parallel) -> {module name: style}), in place.

    `cfg` is the `ParallelismConfig` (`sequence_parallel` is read). Parameters the plan touches
    become DTensors on `tp_mesh`; the sharding engine then shards their local pieces over the
    data-parallel dims. Parameters tied before (same tensor under two names) are tied again.
    """
    if plan_fn is None:
        raise UserInputError(
            f"parallelism.tp > 1 with model class {type(model).__name__}: its family "
            "registers no tensor-parallel plan (tp_plan in framework/models/registry.py); "
            "set parallelism.tp=1"
        )
    tied = _tied_names(model)
    setattr(model, _TP_ATTR, tp_mesh.size())  # also tells the plan the degree, to check widths
    plan = plan_fn(model, cfg.sequence_parallel)
    from framework.peft.lora import split_adapters, take_adapters

    adapters = take_adapters(model)  # LoRA: split to match their layers, after the layers
    # Frozen parameters stay frozen: torch's SequenceParallel re-registers the norms' weights as
    # new nn.Parameters that require grad whatever the old ones did (LoRA freezes them).
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    split_adapters(adapters, tp_mesh)
    for names in tied:
        # Each style distributes the parameter it owns; both ends of a tie get the same
        # placement (the plan must make sure of it), so keep the first and point the others at it.
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if isinstance(first, DTensor) and isinstance(other, DTensor):
                assert first.placements == other.placements, (
                    f"tied parameters {names} got different placements {first.placements} and "
                    f"{other.placements} from the tensor-parallel plan"
                )
            _set_param(model, name, first)
    setattr(model, _TP_ATTR, tp_mesh.size())
    return model


def is_tensor_parallel(model: nn.Module) -> bool:
    return getattr(model, _TP_ATTR, 1) > 1


def loss_context(model: nn.Module) -> ContextManager:
    """`loss_parallel()` for a tensor-parallel model (see [Note: the logits stay sharded on the
    vocabulary]), a no-op otherwise."""
    return loss_parallel() if is_tensor_parallel(model) else contextlib.nullcontext()


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain, whole tensor: a DTensor (the loss, vocabulary-sharded logits) gathered, a plain
    tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
