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
                to the training loss by the causal-LM task (`Transformer.aux_loss`)

Every expert runs its matmuls whether or not a token chose it (an empty batch of rows for an
unchosen one), so each step issues the same operations on every rank and an unchosen expert's
gradient is exactly zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, e = cfg.dim, cfg.n_experts
        f = cfg.moe_ffn_dim or cfg.ffn_dim
        self.n_experts, self.top_k, self.capacity_factor = e, cfg.top_k, cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, d))  # gate
        self.w3 = nn.Parameter(torch.empty(e, f, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, f))  # down
        self.shared = None
        if cfg.n_shared_experts:
            from framework.models.llama.model import FeedForward

            shared = type(cfg)(**{**cfg.__dict__, "ffn_dim": f * cfg.n_shared_experts, "n_experts": 0})
            self.shared = FeedForward(shared)
        self.aux_loss: torch.Tensor | None = None
        self.last_choices: torch.Tensor | None = None  # (tokens, top_k) expert ids of the last forward

    def route(self, tokens: torch.Tensor):
        """(weights, experts): each (tokens, top_k); and the load-balancing loss."""
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        chosen = F.one_hot(experts, self.n_experts).float().sum(1)  # (tokens, experts): 1 where chosen
        share = chosen.mean(0) / self.top_k
        aux = self.n_experts * (share * probs.mean(0)).sum() * self.aux_loss_coef
        return weights.type_as(tokens), experts, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, experts, self.aux_loss = self.route(tokens)
        self.last_choices = experts.detach()
        out = torch.zeros_like(tokens)
        capacity = None
        if self.capacity_factor:
            capacity = math.ceil(self.capacity_factor * tokens.shape[0] * self.top_k / self.n_experts)
        for e in range(self.n_experts):
            rows, slot = (experts == e).nonzero(as_tuple=True)  # token order
            if capacity is not None:
                rows, slot = rows[:capacity], slot[:capacity]
            h = tokens[rows]
            y = F.linear(F.silu(F.linear(h, self.w1[e])) * F.linear(h, self.w3[e]), self.w2[e])
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float, generator=None) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std, generator=generator)
        for w, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            nn.init.normal_(w, mean=0.0, std=s, generator=generator)
