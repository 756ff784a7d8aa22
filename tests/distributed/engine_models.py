"""Tiny models and the per-rank training loop shared by the engine tests (no tests in here).

The models are defined here, not taken from framework/models, so the engine tests depend on the
engine only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    checkpoint = False  # activation checkpointing of the block's body (set per test)

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # no qkv bias: the key bias has an analytically zero gradient (softmax is shift-invariant), whose
        # rounding noise Adam would normalise to +-lr and make any two correct runs differ
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return block_body(self, x)


class TinyGPT(nn.Module):
    """GPT-like: token + position embeddings, pre-LN blocks, final LN, head tied to the embedding."""

    def __init__(
        self, vocab: int = 61, d: int = 32, heads: int = 2, layers: int = 2, seq: int = 8, block: type = None
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList((block or Block)(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: both users live in the root unit

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return gpt_forward(self, idx)


def block_body(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A pre-LN GPT block (`ln1`, `qkv`, `proj`, `ln2`, `fc`, `out`, `heads`): causal attention,
    then a GELU MLP, each added to the residual. The benchmarks' GPT (bench/common.py) has the same
    block, with biased q/k/v."""
    B, T, D = x.shape
    q, k, v = block.qkv(block.ln1(x)).split(D, dim=-1)
    q, k, v = (t.view(B, T, block.heads, D // block.heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.proj(a.transpose(1, 2).reshape(B, T, D))
    return x + block.out(F.gelu(block.fc(block.ln2(x))))


def gpt_forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Token + position embeddings (`tok`, `pos`), the `blocks`, the final norm and the head."""
    x = model.tok(idx) + model.pos[: idx.shape[1]]
    for b in model.blocks:
        x = b(x)
    return model.head(model.ln_f(x))


class TinyMLP(nn.Module):
    """Odd sizes (a 1-element parameter, dim0 < world), a frozen parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(13, 7)
        self.l2 = nn.Linear(7, 3)
        self.l3 = nn.Linear(3, 1)  # weight (1, 3), bias (1,): dim0 < world
        self.frozen = nn.Linear(13, 7)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(1))
        self.register_buffer("shift", torch.full((7,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x) + 0.5 * self.frozen(x) + self.shift)
        return self.l3(torch.tanh(self.l2(h))) * self.scale


def make_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT() if kind == "gpt" else TinyMLP()


def make_batch(kind: str, step: int, global_batch: int):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "gpt":
        idx = torch.randint(0, 61, (global_batch, 9), generator=g)
        return idx[:, :-1], idx[:, 1:]
    x = torch.randn(global_batch, 13, generator=g)
    return x, torch.randn(global_batch, 1, generator=g)


def loss_fn(kind: str, model: nn.Module, x, y) -> torch.Tensor:
    out = model(x)
    if kind == "gpt":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # lr 1e-3: Adam turns a rounding-level difference in a near-zero gradient element (a dead GELU
    # unit's weights, where terms of size ~1 cancel) into a step of up to +-lr, so the divergence of
    # two correct runs scales with lr; torch's own fully_shard shows the same 3e-5 at lr 1e-2.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def shard_model(model: nn.Module, kind: str, engine: str, mesh, reshard: bool, **kw) -> nn.Module:
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from framework.distributed.fsdp import fully_shard
    if kind == "gpt":
        for b in model.blocks:
            fully_shard(b, mesh=mesh, reshard_after_forward=reshard, **kw)
    else:
        fully_shard(model.l1, mesh=mesh, reshard_after_forward=reshard, **kw)
        fully_shard(model.l2, mesh=mesh, reshard_after_forward=reshard, **kw)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **kw)
    return model


def full_params(model: nn.Module) -> dict:
    """Every parameter as a full tensor, by FQN (collective for sharded models)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
        if not k.endswith("shift")
    }


def train_steps(kind, model, opt, steps, global_batch, dp_rank, dp, *, clip=None, accum=1, start=0, engine="ours"):
    """Run `steps` optimizer steps on this rank's slice of the global batch; return the global losses."""
    from framework.distributed.fsdp import clip_grad_norm_

    losses = []
    per = global_batch // dp
    for s in range(start, start + steps):
        x, y = make_batch(kind, s, global_batch)
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        micro = per // accum
        total = 0.0
        for m in range(accum):
            last = m == accum - 1
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(last)
            loss = loss_fn(kind, model, x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]) / accum
            loss.backward()
            total += loss.detach()
        if clip is not None:
            if engine == "ours":
                clip_grad_norm_(model.parameters(), clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = torch.tensor([float(total)], dtype=torch.float64)
        if dist.is_initialized() and dp > 1:
            dist.all_reduce(t)
        losses.append(float(t) / dp)
    return losses


def reference(kind, opt_name, steps, global_batch, *, clip=None, accum=1, seed=0):
    """Single-process run on the global batch from the same initial weights."""
    model = make_model(kind, seed)
    opt = make_optimizer(opt_name, model)
    losses = train_steps(kind, model, opt, steps, global_batch, 0, 1, clip=clip, accum=1, engine="torch")
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("shift")}
