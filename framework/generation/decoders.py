"""How one model family decodes: a session that takes a left-padded batch of prompts and then one
token per row at a time, and returns the last position's logits each time.

    session = decoder_for(model, use_cache=True).start(ids, valid, capacity)   # (batch, vocab)
    logits = session.step(next_ids)                                               # (batch, 1) -> (batch, vocab)

Our Llama (a model with `make_kv_cache`) keeps its own pre-allocated cache ([Note: the Llama KV
cache] in framework/models/llama/kv_cache.py); a Hugging Face causal LM gets transformers' own
`DynamicCache` through its forward (`past_key_values`), with an attention mask and position ids
that skip the left padding. Without the cache every step runs the whole sequence again, under the
same mask and positions: the reference the cached path is tested against.
"""

from __future__ import annotations

import inspect

import torch

from framework.distributed.tensor_parallel import full
from framework.models.tasks import logits_of


def _last(out) -> torch.Tensor:
    """The last position's logits, whole (a tensor-parallel head leaves them sharded), float32."""
    return full(logits_of(out))[:, -1].float()


def positions_of(valid: torch.Tensor) -> torch.Tensor:
    """Each token's position among the real tokens of its row (left padding gets 0)."""
    return (valid.long().cumsum(1) - 1).clamp(min=0)


def is_transformers_model(model) -> bool:
    return hasattr(model, "config") and hasattr(model, "can_generate") and hasattr(model, "get_input_embeddings")


def max_tokens(model) -> int | None:
    """How many tokens (prompt and completion) the model's positions allow; None: no limit known."""
    cfg = getattr(model, "cfg", None)
    if getattr(cfg, "max_seq_len", None):
        return int(cfg.max_seq_len)
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name))
    return None


class _LlamaCached:
    def __init__(self, model) -> None:
        self.model = model

    def start(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        self.cache = self.model.make_kv_cache(ids.shape[0], capacity)
        self.cache.extend(valid)
        return _last(self.model(ids, kv_cache=self.cache))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.extend(torch.ones_like(tokens, dtype=torch.bool))
        return _last(self.model(tokens, kv_cache=self.cache))


class _LlamaFull:
    """Every step the whole sequence; left padding is a document of its own (the packed-rows mask)."""

    def __init__(self, model) -> None:
        self.model = model

    def start(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        self.ids, self.valid = ids, valid
        return self._run()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.ids = torch.cat([self.ids, tokens], dim=1)
        self.valid = torch.cat([self.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        return self._run()

    def _run(self) -> torch.Tensor:
        if bool(self.valid.all()):
            return _last(self.model(self.ids))
        return _last(self.model(self.ids, positions=positions_of(self.valid), document_ids=self.valid.long()))


class _Transformers:
    """A Hugging Face causal LM through its forward: attention_mask and position_ids for the left
    padding, transformers' DynamicCache when cached."""

    def __init__(self, model, use_cache: bool) -> None:
        self.model, self.use_cache = model, use_cache
        self.takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    def _forward(self, ids: torch.Tensor, **extra) -> torch.Tensor:
        kwargs = {"input_ids": ids, "attention_mask": self.valid.long(), **extra}
        if self.takes_positions:
            kwargs["position_ids"] = positions_of(self.valid)[:, -ids.shape[1] :]
        out = self.model(**kwargs)
        self.past = getattr(out, "past_key_values", None)
        return _last(out)

    def start(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        self.ids, self.valid = ids, valid
        if not self.use_cache:
            return self._forward(ids, use_cache=False)
        from transformers import DynamicCache

        return self._forward(ids, use_cache=True, past_key_values=DynamicCache(config=self.model.config))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.valid = torch.cat([self.valid, torch.ones_like(tokens, dtype=torch.bool)], dim=1)
        if self.use_cache:
            return self._forward(tokens, use_cache=True, past_key_values=self.past)
        self.ids = torch.cat([self.ids, tokens], dim=1)
        return self._forward(self.ids, use_cache=False)


def decoder_for(model, use_cache: bool):
    """The decoding session factory for `model`: ours (`make_kv_cache`) or a transformers causal LM."""
    if hasattr(model, "make_kv_cache"):
        return _LlamaCached(model) if use_cache else _LlamaFull(model)
    if is_transformers_model(model):
        return _Transformers(model, use_cache)
    raise ValueError(
        f"generation: {type(model).__name__} is neither our Llama (make_kv_cache) nor a transformers causal LM"
    )
