"""Context parallelism for Hugging Face models: transformers' attention split over the sequence as
our Llama's is ([Note: context parallelism by all-to-all] in framework/distributed/context_parallel.py).

[Note: context parallelism inside a transformers model]
A transformers decoder (Llama, Mistral, Qwen2, and the mixture-of-experts Mixtral, Qwen3-MoE,
DeepSeek-V3, gpt-oss) computes, per block: q/k/v projections (Qwen3-MoE's q/k norms, DeepSeek-V3's
latent projections), the rotary
embedding from `position_ids`, then `ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module,
q, k, v, mask, scaling=..., sliding_window=...)`, then o_proj. Everything but that call is per token.
So nothing of transformers is changed; the model is only told, on its own config, to use an
attention implementation registered under `ATTENTION` (the library's documented extension point):

- each cp rank holds tokens [i s/cp, (i+1) s/cp) of every row (`split_batch`, as for our Llama);
- a forward pre-hook on the model gives it those tokens' positions in the whole row as
  `position_ids` (transformers would number the chunk from 0), so the rotary embedding applied
  before the attention call is the one-process one;
- the registered function moves q, k, v (batch, heads, s/cp, d) to whole sequences of heads/cp heads
  by the exchange's all-to-all, attends with the causal mask over the whole sequence (and the
  layer's sliding window, i - j < window, as transformers' mask), and moves the output back. The
  mask transformers built for the chunk is not used (it numbers the chunk's keys from 0): the rows
  carry no padding mask under cp (the hook refuses one), so the whole sequence's mask is causal.
- DeepSeek-V3's MLA: the value head dim differs from the query/key one, which the exchange (any
  last dim) and sdpa take as they are. gpt-oss passes its attention sinks (`s_aux`, one logit per
  head joining each row's softmax): after the exchange the rank holds heads [r h/cp, (r+1) h/cp),
  so it attends with those heads' sinks (`_with_sinks`, transformers' eager gpt-oss attention).
- The experts and their routers see tokens only: each cp rank routes its chunk's tokens, as one
  process routes every token alone (top-k of each token's own scores, dropless), and under
  `parallelism.ep` exchanges them within its ep group. transformers' models add no load-balancing
  loss to ours (only when given the labels), so the split changes no routing and no loss.
- Outside `active(model)` (sampling, evaluation of whole sequences) the function is transformers'
  sdpa, with sdpa's masks: the model computes as an unsplit one.

Model types whose attention is this shape are listed in `SPLIT` (each tested against one process);
the others are refused before any rank starts (args.py), by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from framework.errors import UserInputError
from framework.models.hf.args import CONTEXT_PARALLEL_TYPES as SPLIT

ATTENTION = "framework_sequence_exchange"  # the attention implementation's registered name


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the whole-sequence path's masks: sdpa's


def _attention_modules(model: nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "o_proj")]


def prepare_context_parallel(model: nn.Module, cp: int) -> None:
    """Ready a transformers model for the sequence exchange over `cp` ranks: its attention modules
    marked with `sequence_exchange` (which `apply_context_parallel` then sets), the registered
    attention implementation selected on its config, and the hook giving the chunk's positions.
    What the job's config did not state (heads left to the config class's default) is checked here."""
    kind = getattr(model.config, "model_type", type(model).__name__)
    modules = _attention_modules(model)
    if kind not in SPLIT or not modules:
        raise UserInputError(
            f"parallelism.cp > 1 with model=hf model_type={kind}: only {', '.join(SPLIT)} attention is split "
            "over the sequence here; set parallelism.cp=1"
        )
    tp = getattr(model, "_framework_tp_degree", 0) or 1  # apply_tensor_parallel's mark, before this
    heads = int(model.config.num_attention_heads)
    if heads % tp or (heads // tp) % cp:
        raise UserInputError(
            f"parallelism.cp={cp} does not divide the {heads // tp} attention heads per tensor-parallel rank "
            f"of model=hf (num_attention_heads={heads}, tp={tp}); choose a cp that divides them"
        )
    _register()
    model.set_attn_implementation(ATTENTION)
    for module in modules:
        module.sequence_exchange = None
    model.register_forward_pre_hook(_chunk_positions, with_kwargs=True)


def _exchange_of(model: nn.Module):
    exchange = getattr(model, "_framework_sequence_exchange", None)
    return exchange if exchange is not None and exchange.active else None


def _chunk_positions(model: nn.Module, args: tuple, kwargs: dict):
    """Under the exchange, the chunk's tokens at their positions in the whole row."""
    exchange = _exchange_of(model)
    if exchange is None:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "context parallelism with model=hf splits causal rows without a padding mask; this forward "
            "passed an attention_mask with padding"
        )
    if kwargs.get("position_ids") is None:
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        n = tokens.shape[1]
        start = exchange.rank * n
        kwargs["position_ids"] = torch.arange(start, start + n, device=tokens.device)[None]
    return args, kwargs


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    """transformers' attention call: q (batch, heads, s/cp, d), k and v (batch, kv heads, s/cp, d)
    -> (batch, s/cp, heads, d); see [Note: context parallelism inside a transformers model]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    exchange = getattr(module, "sequence_exchange", None)
    sinks = kwargs.pop("s_aux", None)
    if (exchange is None or not exchange.active) and sinks is not None:
        # sdpa takes no sinks: the whole sequence through the same sink attention, all heads
        groups = module.num_key_value_groups
        k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        allowed = attention_mask
        if allowed is None:  # sdpa's mask skipped: causal, the queries the keys' last ones
            i, j = torch.arange(query.shape[2], device=query.device), torch.arange(k.shape[2], device=query.device)
            allowed = j[None, :] <= i[:, None] + (k.shape[2] - query.shape[2])
        return _with_sinks(query, k, v, allowed, sinks, 0, scaling, dropout, module.training), None
    if exchange is None or not exchange.active:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"context parallelism with model=hf: {type(module).__name__} passes {name}")
    groups = module.num_key_value_groups
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, s/cp, heads, d)
    if groups > 1 and k.shape[2] % exchange.size:  # KV heads cp does not divide: one per query head
        k, v, groups = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2), 1
    q, k, v = (exchange.to_heads(t).transpose(1, 2) for t in (q, k, v))  # (batch, heads/cp, s, d)
    if groups > 1:  # rank r's query heads are r's KV heads' groups, in order (as transformers' repeat_kv)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seq = q.shape[2]
    mask = None
    if sliding_window is not None and sliding_window < seq:
        i = torch.arange(seq, device=q.device)
        distance = i[:, None] - i[None, :]
        mask = (distance >= 0) & (distance < sliding_window)
    if sinks is not None:  # gpt-oss: this rank's heads' sink logits join each row's softmax
        if mask is None:
            i = torch.arange(seq, device=q.device)
            mask = i[:, None] >= i[None, :]
        out = _with_sinks(q, k, v, mask, sinks, exchange.rank * q.shape[1], scaling, dropout, module.training)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None
        ).transpose(1, 2)  # (batch, s, heads/cp, d)
    return exchange.to_sequence(out.contiguous()), None


def _with_sinks(q, k, v, allowed, sinks, first, scaling, dropout, training):
    """Attention whose softmax over a row's keys also takes one logit per head, dropped after it
    (gpt-oss's attention sinks: `s_aux`, one per head of this tensor-parallel rank; `first`: the
    index among them of q's first head, r h/cp after the exchange). `allowed`: a boolean mask
    broadcastable to the scores, True where a query sees a key. Computed as transformers' eager
    gpt-oss attention: scores, the mask, the sink column, the max taken off, softmax, the sink
    dropped. q, k, v: (batch, heads, s, d) -> (batch, s, heads, d)."""
    heads, seq = q.shape[1], q.shape[2]
    mine = sinks.reshape(-1)[first : first + heads]
    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed.bool(), torch.finfo(scores.dtype).min)
    column = mine.reshape(1, -1, 1, 1).expand(q.shape[0], -1, seq, 1).to(scores.dtype)
    logits = torch.cat([scores, column], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = F.softmax(logits, dim=-1)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2)
