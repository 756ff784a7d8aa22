"""A mixture-of-experts model's router bookkeeping around one optimizer step: the forward-only
routing pass that gives the global-batch load-balancing loss its shares, the aux-loss-free bias
update, and the step's router statistics for metrics.jsonl.

A router is any module with the attributes framework/models/llama/moe.py's `MoE` sets for this
(`routing_ahead`, `ahead_load`, `global_load`, `step_load`, `step_dropped`, `expert_bias`; a
transformers model's routers get them from framework/models/hf/moe.py's `count_routers`); the
trainer builds `RouterSteps.of(model)` (None for a model without one) and calls `begin` before the
step's micro-batches and `end` after their backward passes.

[Note: global-batch load balancing]
The Switch loss of one router over a set B of tokens is

    aux(B) = c x E x sum_i s_i(B) x P_i(B),   s_i(B) = C_i(B) / (|B| x k),   P_i(B) = mean_{t in B} p_ti

with c = aux_loss_coef, E experts, k = top_k, C_i(B) the slots of B's tokens routed to expert i
(a count: no gradient) and p_ti token t's router probability of i. Taken per micro-batch, B is
what one rank sees in one micro-batch, so the loss (and the gradient) changes with the micro-batch
size and the number of data-parallel ranks. We want B = G, the whole global batch, on every layout.

s_i(G) is a constant of the step once every micro-batch is routed, and aux(G) is linear in the
probabilities given it. The trainer's objective is the mean over the W ranks and A micro-batches
of each micro-batch's loss, every micro-batch holding |G| / (W x A) tokens (rows of one length;
the cross-entropy's mean of means assumes it too). So if micro-batch (r, m) adds

    c x E x sum_i s_i(G) x P_i(B_rm)

then the mean over (r, m) is c x E x sum_i s_i(G) x P_i(G) = aux(G) exactly, and so is its
gradient: c x E x s_i(G) / |G| on every token's p_ti, whatever the layout. What remains is to know
s_i(G) before the first micro-batch's backward. `begin` routes the step's micro-batches ahead, in
a forward without gradients (each rank its own micro-batches, the same forward as the training
one: the same weights, inputs and operations, hence the same choices), and sums each router's
counts over all ranks: one all-reduce of (routers x experts) numbers (in a pipeline: the pass
through the stages, summed over the ranks holding the same stages, [Note: routers in a pipeline]
in framework/distributed/pipeline_routing.py). The price is one more forward per step;
`aux_loss_scope=micro_batch` skips it and keeps the per-micro-batch loss.

Tested: tests/models/test_moe_balance.py (one process, ep=2 with one micro-batch of 8 and ep=2
with four of 2 give the same five losses within 1e-5; per micro-batch they differ by ~1e-4), and
in pipelines tests/models/test_moe_balance_pipeline.py.

The counts for the bias and the record (`step_load`) are taken in the training forwards
themselves, not in the pass ahead, so they also hold the capacity's dropped slots; activation
checkpointing's recompute does not count twice (framework/recompute.py).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional

import torch

from framework.distributed.fsdp.collectives import all_reduce_sum_


class RouterSteps:
    def __init__(self, routers: List[torch.nn.Module], group=None):
        self.routers = routers
        self.group = group  # the ranks whose routers are these (None: all): [Note: routers in a pipeline]

    @classmethod
    def of(cls, model: torch.nn.Module, group=None) -> Optional["RouterSteps"]:
        routers = [m for m in model.modules() if hasattr(m, "routing_ahead")]
        return cls(routers, group) if routers else None

    @property
    def routes_ahead(self) -> bool:
        """Whether a global-batch balancing loss needs the step's routing before its backward."""
        return any(r.aux_loss_scope == "global_batch" and r.aux_loss_coef > 0 for r in self.routers)

    def begin(self, batches: Iterable, forward: Callable, device=None) -> None:
        """Start a step: clear the counts; with `routes_ahead`, run `forward(batch)` (the task's
        loss) without gradients on each of this rank's micro-batches and set every router's
        `global_load`, its slots per expert summed over all ranks (`group`'s). Collective. In a
        pipeline a router no stage of this rank holds counts zeros (on `device`), as in `end`."""
        for r in self.routers:
            r.step_load, r.step_dropped, r.global_load = None, 0, None
        if not self.routes_ahead:
            return
        for r in self.routers:
            r.routing_ahead, r.ahead_load = True, None
        try:
            with torch.no_grad():
                for batch in batches:
                    forward(batch)
        finally:
            for r in self.routers:
                r.routing_ahead = False
        loads = all_reduce_sum_(torch.stack([_or_zeros(r, r.ahead_load, device) for r in self.routers]), self.group)
        for r, load in zip(self.routers, loads):
            r.global_load = load

    def end(self, read: bool, device=None, copies: int = 1) -> Dict[str, object]:
        """End a step: move the aux-loss-free biases by the step's global loads; with `read`, the
        step's record: per router l (in model order) `moe_load_l<l>` (slots per expert over the
        global batch: they sum to tokens x top_k), `moe_max_mean_l<l>` (the busiest expert's load
        over the mean) and, under a capacity factor, `moe_dropped_l<l>` (slots dropped).
        Collective when a router has a bias or `read`. In a pipeline the routers are the whole
        model's and a rank counts its stages' only: the others' rows are zeros on `device` (the
        step's device), and the sum over all ranks gives every router its global batch's loads.
        `copies`: the ranks routing the same tokens (the tp ranks, which hold the routers whole and
        route the replicated stream alike): the sum counts each slot that many times."""
        biased = [r for r in self.routers if r.expert_bias is not None]
        for r in self.routers:
            r.global_load = None  # the pass ahead's shares are this step's only
        if not (read or biased):
            return {}
        rows = []
        for r in self.routers:
            load = _or_zeros(r, r.step_load, device)  # zeros: no training forward reached it (another rank's stage)
            rows.append(torch.cat([load.float(), load.new_tensor([float(r.step_dropped)])]))
        totals = all_reduce_sum_(torch.stack(rows), self.group) / copies  # exact: multiples of copies
        for r, row in zip(self.routers, totals):
            if r.expert_bias is not None:  # DeepSeek-V3: an expert above the mean load loses bias
                load = row[:-1].to(r.expert_bias.device)
                r.expert_bias += r.bias_update_rate * torch.sign(load.mean() - load)
        if not read:
            return {}
        out: Dict[str, object] = {}
        for index, (r, row) in enumerate(zip(self.routers, totals.tolist())):
            load, dropped = row[:-1], row[-1]
            out[f"moe_load_l{index}"] = [int(x) for x in load]
            mean = sum(load) / len(load)
            out[f"moe_max_mean_l{index}"] = max(load) / mean if mean else 0.0
            if r.capacity_factor:
                out[f"moe_dropped_l{index}"] = int(dropped)
        return out


def _or_zeros(router, load, device):
    """A router's load, or zeros where this rank's forwards did not reach it (a pipeline's other stage)."""
    if load is not None:
        return load.float()
    weight = getattr(router, "router", router).weight  # ours keeps a Linear `router`; transformers' is one
    return torch.zeros(router.n_experts, device=device if device is not None else weight.device)
