"""transformers' mixture-of-experts blocks, split by expert (`parallelism.ep` with `model=hf`).

[Note: Hugging Face experts by expert]
transformers 5 keeps a block's experts as stacked tensors with the expert on dim 0
(`experts.gate_up_proj`, `experts.down_proj`, and gpt-oss's biases) in one module that its
`use_experts_implementation` decorator marks, called by the block as
`experts(tokens, top_k_index, top_k_weights)` after the router (Mixtral, Qwen3-MoE, DeepSeek-V3,
gpt-oss and the other families built the same way). `make_splittable` gives each such module the
shape expert parallelism looks for (framework/distributed/expert_parallel.py: a `dispatch`
attribute, every own tensor with the expert on dim 0) without changing what it computes:

- `dispatch` None (no expert parallelism): the module's own forward, untouched;
- `dispatch` set: the rows each expert was chosen for are grouped by expert (token order within
  a top-k slot, as transformers' eager loop takes them), sent to the rank holding the expert and
  back by `dispatch`; there the held experts run through the module's own forward (the
  implementation its config names, `config._experts_implementation`), called on a view of the
  module holding the local experts only, each row routed to its expert with weight 1 (exact: a
  product with 1 and a sum of one term change no bit). Home again, each row is weighted by its
  routing weight and the top-k slots of a token are summed in slot order, as transformers'
  grouped and batched implementations sum them.

The router, the shared experts (DeepSeek-V3) and everything else of the block run on every rank
as without expert parallelism; only the stacked tensors are split.
"""

from __future__ import annotations

import torch
from torch import nn


def is_hf_experts(module: nn.Module) -> bool:
    """A module transformers' `use_experts_implementation` built (stacked experts on dim 0)."""
    return hasattr(module, "_is_expert_parallel") and isinstance(getattr(module, "num_experts", None), int)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if hasattr(w, "to_local") else w


class _Held:
    """The experts module as its own forward reads it, holding only this rank's experts: the
    stacked tensors are the local pieces and `num_experts` their count; every other attribute
    (the activation, the gate, the layout flags, the config) is the module's."""

    def __init__(self, module: nn.Module):
        object.__setattr__(self, "_module", module)
        # the attributes, which forward reads (gathered while the engine has the module unsharded)
        tensors = {name: _local(getattr(module, name)) for name, _ in module.named_parameters(recurse=False)}
        self.__dict__.update(tensors)
        self.num_experts = next(iter(tensors.values())).shape[0]

    def __getattr__(self, name):
        return getattr(self._module, name)


def _split_forward(base: type, self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights):
    """`base`: transformers' experts class. See [Note: Hugging Face experts by expert]."""
    dispatch = self.dispatch
    if dispatch is None:
        return base.forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, k = top_k_index.shape
    routed, inputs = [], []
    for e in range(self.num_experts):
        slot, rows = torch.where(top_k_index.t() == e)  # slot-major, token order within a slot
        routed.append(rows * k + slot)  # the (token, slot) pair's place in a (tokens * k) list
        inputs.append(hidden_states[rows])
    outputs = dispatch(inputs, lambda per_expert: _run_held(base, self, per_expert))
    weights = top_k_weights.reshape(-1)
    place = torch.cat(routed)
    weighted = torch.cat(outputs) * weights[place, None]  # in the weights' precision, as transformers
    pairs = weighted.new_zeros((tokens * k, weighted.shape[-1])).index_copy(0, place, weighted)
    return pairs.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _run_held(base: type, module: nn.Module, per_expert: list) -> list:
    """The held experts' outputs, unweighted, for the rows of each (a list in held order)."""
    held = _Held(module)
    sizes = [r.shape[0] for r in per_expert]
    rows = torch.cat(per_expert)
    ids = torch.repeat_interleave(torch.arange(len(sizes), device=rows.device), torch.tensor(sizes, device=rows.device))
    ones = rows.new_ones((rows.shape[0], 1))
    out = base.forward(held, rows, ids[:, None], ones)
    if rows.requires_grad and not out.requires_grad:
        # No row came (transformers' eager loop then skips every expert): the rows' gradient must
        # still flow back through the all-to-all, which every rank of the group joins in backward.
        out = out + rows * 0
    return list(out.split(sizes))


_SPLITTABLE: dict[type, type] = {}


def _forward_of(base: type):
    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        return _split_forward(base, self, hidden_states, top_k_index, top_k_weights)

    return forward


def make_splittable(model: nn.Module) -> int:
    """Give every transformers experts module of `model` a `dispatch` (None) and the forward of
    [Note: Hugging Face experts by expert]; returns how many there are."""
    found = 0
    for module in model.modules():
        if not is_hf_experts(module) or hasattr(module, "dispatch"):
            continue
        cls = type(module)
        if cls not in _SPLITTABLE:
            _SPLITTABLE[cls] = type(
                cls.__name__,
                (cls,),
                {
                    "forward": _forward_of(cls),
                    "dispatch": None,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__,
                },
            )
        module.__class__ = _SPLITTABLE[cls]
        found += 1
    return found


# [Note: Hugging Face routers' statistics]
# transformers' routers (Mixtral's, Qwen3-MoE's and gpt-oss's `TopKRouter`, DeepSeek-V3's
# `TopkRouter`) are the experts module's sibling (`gate`, gpt-oss's `router`) and return
# (logits, top-k weights, top-k expert ids). `count_routers` gives each the attributes
# framework/routing.py's `RouterSteps` reads of a router and a forward hook counting the top-k ids
# per expert into `step_load` in training forwards (gradients on, not activation checkpointing's
# recompute, as our Llama's routers count), so the step's record has the same `moe_load_l<l>` and
# `moe_max_mean_l<l>` keys, summed over all ranks by `RouterSteps.end`. transformers' models add no
# load-balancing loss to ours and no bias moves (DeepSeek-V3's `e_score_correction_bias` stays as
# transformers trains it): nothing routes ahead, the counts are the record only.


def _router_of(parent: nn.Module):
    for name in ("gate", "router"):
        child = getattr(parent, name, None)
        if isinstance(child, nn.Module) and isinstance(getattr(child, "top_k", None), int):
            return child
    return None


def _count(router: nn.Module, args, output) -> None:
    from framework.recompute import recomputing

    if router.routing_ahead or not torch.is_grad_enabled() or recomputing():
        return  # an evaluation's forward, or the recompute of a counted one
    ids = output[-1]
    load = torch.bincount(ids.reshape(-1), minlength=router.n_experts).float()
    router.step_load = load if router.step_load is None else router.step_load + load


def count_routers(model: nn.Module) -> int:
    """Ready every transformers router of `model` for the step's statistics ([Note: Hugging Face
    routers' statistics]); returns how many there are."""
    found = 0
    for parent in model.modules():
        experts = getattr(parent, "experts", None)
        router = _router_of(parent)
        if router is None or not isinstance(experts, nn.Module) or not is_hf_experts(experts):
            continue
        if hasattr(router, "routing_ahead"):
            continue
        router.n_experts = experts.num_experts
        router.routing_ahead, router.ahead_load, router.global_load = False, None, None
        router.step_load, router.step_dropped, router.expert_bias = None, 0, None
        router.aux_loss_scope, router.aux_loss_coef, router.capacity_factor = "none", 0.0, None
        router.counts_only = True  # no loss, no bias: the record only
        router.register_forward_hook(_count)
        found += 1
    return found
