"""A mixture-of-experts feed-forward block for our Llama (`model.args.n_experts > 0`).

    router      a linear map to one logit per expert; softmax, then each token's top_k experts,
                their weights renormalised to sum to 1 (as Mixtral)
    experts     n_experts SwiGLUs stored as three stacked tensors (experts, out, in), so a sharding
                unit holds them whole and the planner counts them as three tensors
    shared      n_shared_experts SwiGLUs every token goes through as well (one wider SwiGLU)
    capacity    capacity_factor = 0: dropless, every routed token is computed; > 0: an expert takes
                at most ceil(factor x tokens x top_k / n_experts) tokens, in token order, and a
                token that finds its expert full keeps only its other experts' outputs
    aux loss    Switch Transformer's load-balancing loss, n_experts x sum_e (share of the routed
                slots that chose e) x (mean router probability of e), times aux_loss_coef, added
                to the training loss by the causal-LM task (`Transformer.aux_loss`); the shares
                are this micro-batch's (aux_loss_scope=micro_batch, the default) or the whole
                global batch's (global_batch: [Note: global-batch load balancing] in
                framework/routing.py)
    bias        bias_update_rate > 0: DeepSeek-V3's aux-loss-free balancing, a per-expert bias
                added to the router probabilities for choosing the experts only (the weights stay
                the unbiased probabilities), moved after every step by the rate towards the
                global batch's mean load (framework/routing.py); a buffer, so checkpoints hold it

Every expert runs its matmuls whether or not a token chose it (an empty batch of rows for an
unchosen one), so each step issues the same operations on every rank and an unchosen expert's
gradient is exactly zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.llama.feed_forward import FeedForward
from framework.recompute import recomputing


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, e = cfg.dim, cfg.n_experts
        f = cfg.moe_ffn_dim or cfg.ffn_dim
        self.n_experts, self.top_k, self.capacity_factor = e, cfg.top_k, cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, f, d)
        self.shared = None
        if cfg.n_shared_experts:
            shared = type(cfg)(**{**cfg.__dict__, "ffn_dim": f * cfg.n_shared_experts, "n_experts": 0})
            self.shared = FeedForward(shared)
        self.aux_loss: torch.Tensor | None = None
        self.last_choices: torch.Tensor | None = None  # (tokens, top_k) expert ids of the last forward
        self.aux_loss_scope, self.bias_update_rate = cfg.aux_loss_scope, cfg.bias_update_rate
        if cfg.bias_update_rate:  # persistent only when used: checkpoints without it still load
            self.register_buffer("expert_bias", torch.zeros(e))
        else:
            self.expert_bias = None
        # What the step's router bookkeeping reads and sets (framework/routing.py):
        self.routing_ahead = False  # forward-only routing pass: count into `ahead_load`, nothing else
        self.ahead_load: torch.Tensor | None = None  # this rank's routed slots per expert in that pass
        self.global_load: torch.Tensor | None = None  # the global batch's slots per expert, this step
        self.step_load: torch.Tensor | None = None  # this rank's routed slots per expert in training
        self.step_dropped = 0  # ... forwards since the last reset, and the slots the capacity dropped

    def route(self, tokens: torch.Tensor):
        """(weights, experts): each (tokens, top_k); the load-balancing loss; the routed slots per
        expert."""
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        if self.expert_bias is None:
            weights, experts = probs.topk(self.top_k, dim=-1)
        else:  # the bias chooses; the unbiased probabilities weigh
            experts = (probs.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        load = torch.bincount(experts.reshape(-1), minlength=self.n_experts).float()
        if self.global_load is not None and self.aux_loss_scope == "global_batch":
            # [Note: global-batch load balancing]: the global batch's shares, constants here
            share = self.global_load / self.global_load.sum()
        else:
            share = load / load.sum()
        aux = self.n_experts * (share * probs.mean(0)).sum() * self.aux_loss_coef
        return weights.type_as(tokens), experts, aux, load

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, self.aux_loss, load = self.route(tokens)
        self.last_choices = experts.detach()
        counted = not self.routing_ahead and torch.is_grad_enabled() and not recomputing()
        if self.routing_ahead:
            self.ahead_load = load if self.ahead_load is None else self.ahead_load + load
        elif counted:  # a training forward (not an evaluation's, nor checkpointing's recompute)
            self.step_load = load if self.step_load is None else self.step_load + load
        out = torch.zeros_like(tokens)
        capacity = None
        if self.capacity_factor:
            capacity = math.ceil(self.capacity_factor * tokens.shape[0] * self.top_k / self.n_experts)
        routed = []  # per expert: (the token rows it takes, which of their top_k slots chose it)
        for e in range(self.n_experts):
            rows, slot = (experts == e).nonzero(as_tuple=True)  # token order
            if capacity is not None:
                if counted:
                    self.step_dropped += max(rows.numel() - capacity, 0)
                rows, slot = rows[:capacity], slot[:capacity]
            routed.append((rows, slot))
        inputs = [tokens[rows] for rows, _ in routed]
        dispatch = self.experts.dispatch
        outputs = self.experts(inputs) if dispatch is None else dispatch(inputs, self.experts)
        for (rows, slot), y in zip(routed, outputs):
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float, generator=None) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std, generator=generator)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        x = self.experts
        for w, s in ((x.w1, std), (x.w3, std), (x.w2, out_std)):
            nn.init.normal_(w, mean=0.0, std=s, generator=generator)


class Experts(nn.Module):
    """n SwiGLUs stored as three stacked tensors (experts, out, in), applied to one batch of rows
    per expert. Under expert parallelism (`parallelism.ep`, framework/distributed/expert_parallel.py)
    each tensor is split on the expert dim across the ep ranks, and `dispatch` (set there) sends
    each expert's rows to the rank holding it and brings the results back; this module then
    computes only the experts it holds, on rows from every rank of its group."""

    def __init__(self, n: int, f: int, d: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, f, d))  # gate
        self.w3 = nn.Parameter(torch.empty(n, f, d))  # up
        self.w2 = nn.Parameter(torch.empty(n, d, f))  # down
        self.dispatch = None  # (rows per expert, this module) -> outputs per expert, when split

    def forward(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """One output per held expert, for `rows[i]`: the rows of the i-th expert this rank holds.
        Every expert runs its matmuls, on zero rows if none came, so every rank issues the same
        operations and an unchosen expert's gradient is exactly zero."""
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        return [F.linear(F.silu(F.linear(h, w1[i])) * F.linear(h, w3[i]), w2[i]) for i, h in enumerate(rows)]


def _local(w: torch.Tensor) -> torch.Tensor:
    """The experts this rank holds: all of them, or its split under expert parallelism (a DTensor)."""
    return w.to_local() if hasattr(w, "to_local") else w
