"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

A plain nn.Module with no parallel code: parallelism is applied after construction
(`framework/distributed/parallelize.py`). Head counts inside attention are derived from the local
weight shapes (`view(..., -1, head_dim)`) so that tensor parallelism can split q/k/v column-wise
without the model knowing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.llama.args import LlamaArgs, llama_args
from framework.models.llama.feed_forward import FeedForward
from framework.models.llama.kv_cache import KVCache, LayerCache
from framework.models.llama.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def llama3_frequencies(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3's rope scaling: frequencies whose wavelength is longer than the original context /
    low_freq_factor are divided by `factor`, those shorter than context / high_freq_factor are
    kept, and the band between is interpolated linearly in context / wavelength."""
    context = float(original_max_position_embeddings)
    wavelength = 2 * math.pi / inv_freq
    ratio = context / wavelength  # how many wavelengths fit in the original context
    blend = ((ratio - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def rotary_table(
    head_dim: int, max_seq_len: int, theta: float, device=None, scaling: dict | None = None
) -> torch.Tensor:
    """(max_seq_len, head_dim) table: cos in the first half of the last dim, sin in the second.
    `scaling`: None, or {rope_type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings} (model.args.rope_scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling:
        params = {k: v for k, v in scaling.items() if k not in ("rope_type", "type")}
        inv_freq = llama3_frequencies(inv_freq, **params)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x (batch, seq, heads, head_dim). `table` is the
    rotary table (positions 0, 1, ... of every row) or its rows per token, (batch, seq, head_dim)
    (packed documents: each one's positions start again at 0)."""
    half = x.shape[-1] // 2
    if table.dim() == 3:
        cos, sin = table[..., None, :half], table[..., None, half:]
    else:
        cos = table[: x.shape[1], :half][None, :, None, :]
        sin = table[: x.shape[1], half:][None, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads  # query heads per KV head
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Set by context parallelism (framework/distributed/context_parallel.py): this rank holds
        # 1/cp of the sequence, and q/k/v travel to whole sequences of 1/cp of the heads and back.
        self.sequence_exchange = None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        exchange = (
            self.sequence_exchange if self.sequence_exchange is not None and self.sequence_exchange.active else None
        )
        n_rep = self.n_rep
        if exchange is not None:
            if n_rep > 1 and k.shape[2] % exchange.size:  # KV heads cp does not divide: one per query head
                k, v, n_rep = k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2), 1
            q, k, v = exchange.to_heads(q), exchange.to_heads(k), exchange.to_heads(v)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)  # whole sequences (positions from 0)
        if cache is not None:  # decoding: the new tokens' keys join those of the earlier ones
            k, v = cache.update(k, v)
            # mask: (batch, 1, new, cached) from the cache, or None where each new token (one per
            # row, no padding) attends to every cached one; the KV heads are shared in place
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=n_rep > 1
            ).transpose(1, 2)
            return self.wo(out.reshape(bsz, seq, -1))
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=2)
            v = v.repeat_interleave(n_rep, dim=2)
        # mask: None (causal) or (batch, 1, seq, seq) booleans, True where a query may attend.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None
        ).transpose(1, 2)
        if exchange is not None:
            out = exchange.to_sequence(out)
        return self.wo(out.reshape(bsz, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.n_experts else FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


def document_mask(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The block-diagonal causal mask (batch, 1, seq, seq) of packed rows: a token attends to the
    earlier tokens of its own document; None without document ids (plain causal attention)."""
    if document_ids is None:
        return None
    seq = document_ids.shape[1]  # the whole row's (context parallelism passes a chunk of tokens)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaArgs):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("model.args.vocab_size must be resolved (from the tokenizer) before building")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", torch.empty(cfg.max_seq_len, cfg.dim // cfg.n_heads), persistent=False)

    def _apply(self, fn, recurse=True):
        # Moving between device types (e.g. `to_empty` from meta) builds new Parameter objects per
        # module, which would silently untie a shared embedding/head: tie them again afterwards.
        result = super()._apply(fn, recurse)
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return result

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab). Packed sequences (several documents in one row) pass each
        token's position inside its document and its document's id, both (batch, seq): a token
        then attends only to earlier tokens of its own document (a block-diagonal causal mask).
        Decoding passes a `kv_cache` (`make_kv_cache`) whose `extend` announced these tokens: they
        attend to the cached ones, at the positions and under the mask the cache gives."""
        if kv_cache is not None:
            return self._decode(tokens, kv_cache)
        h = self.tok_embeddings(tokens)
        rope = self.rope if positions is None else self.rope[positions]
        mask = document_mask(document_ids)
        for layer in self.layers:
            h = layer(h, rope, mask=mask)
        return self.output(self.norm(h))

    def _decode(self, tokens: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        exchanges = [layer.attention.sequence_exchange for layer in self.layers]
        if any(e is not None and e.active for e in exchanges):
            raise ValueError("the KV cache holds whole sequences: decode outside context parallelism's `active`")
        h = self.tok_embeddings(tokens)
        rope, mask = self.rope[kv_cache.positions], kv_cache.mask
        for layer, cache in zip(self.layers, kv_cache.layers):
            h = layer(h, rope, mask=mask, cache=cache)
        kv_cache.advance()
        return self.output(self.norm(h))

    def make_kv_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for `batch` rows of up to `capacity` tokens ([Note: the Llama KV cache])."""
        if capacity > self.cfg.max_seq_len:
            raise ValueError(
                f"{capacity} tokens exceed the rotary table of model.args.max_seq_len={self.cfg.max_seq_len}"
            )
        return KVCache(len(self.layers), batch, capacity, self.rope.device)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The mixture-of-experts blocks' load-balancing loss of the last forward (None: dense)."""
        if not self.cfg.n_experts:  # dense: nothing to walk (this is read every step)
            return None
        losses = [layer.feed_forward.aux_loss for layer in self.layers if layer.feed_forward.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter and the rotary table in place (also after `to_empty`).

        Output projections of each block are scaled by 1/sqrt(2 * n_layers) (GPT-2's residual
        scaling), so the residual stream's variance does not grow with depth.
        """
        gen = None
        if seed is not None and self.tok_embeddings.weight.device.type == "cpu":
            gen = torch.Generator().manual_seed(seed)
        std = self.cfg.init_std
        self.rope.copy_(
            rotary_table(
                self.cfg.dim // self.cfg.n_heads,
                self.cfg.max_seq_len,
                self.cfg.rope_theta,
                device=self.rope.device,
                scaling=self.cfg.rope_scaling,
            )
        )
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif hasattr(module, "router"):  # a mixture-of-experts block (its shared expert below)
                module.reset_parameters(std, out_std, generator=gen)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.output and self.cfg.tie_embeddings:
                    continue
                scale = std / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo", "w2")) else std
                nn.init.normal_(module.weight, mean=0.0, std=scale, generator=gen)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        seen = {id(p): p for p in self.parameters()}
        total = sum(p.numel() for p in seen.values())
        if exclude_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x (non-embedding params a token uses: top_k of each block's
        experts) + attention's 12 x layers x dim x seq."""
        n = self.num_params(exclude_embeddings=True)
        c = self.cfg
        if c.n_experts:
            per_expert = 3 * c.dim * (c.moe_ffn_dim or c.ffn_dim)
            n -= c.n_layers * (c.n_experts - c.top_k) * per_expert
        return 6.0 * n + 12.0 * self.cfg.n_layers * self.cfg.dim * seq_len


def build_llama(cfg, device: str | torch.device = "cpu") -> Transformer:
    """The Llama a ModelConfig describes (its `model.args`), on `device` (meta: no memory)."""
    args = llama_args(cfg)
    with torch.device(device):
        return Transformer(args)
