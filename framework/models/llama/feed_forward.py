"""Our Llama's feed-forward block, a SwiGLU: used by every dense block (model.py) and as the
shared experts of a mixture-of-experts block (moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.llama.args import LlamaArgs


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
