"""The Llama's key/value cache for decoding (framework/generation): keys and values of every token
seen so far, per layer, so each new token runs attention against them instead of recomputing the
whole sequence.

    cache = model.make_kv_cache(batch, capacity)
    cache.extend(valid)                  # (batch, new) booleans: False marks left padding
    logits = model(tokens, kv_cache=cache)

[Note: the Llama KV cache]
Each layer's keys and values live in one buffer of (batch, capacity, local KV heads, head_dim),
allocated at the layer's first write (the head count is the layer's own: tensor parallelism gives
each rank n_kv_heads / tp) and written in place after that; `capacity` is the prompt plus the
tokens to generate, so nothing is reallocated while decoding. Rows are left-padded: slot t of a row
holds a real token when `valid[row, t]`. A token's rotary position is the number of real tokens
before it in its row, so a prompt has the same positions (0, 1, ...) whatever padding its batch
gave it. A query attends to the real keys at or before its slot; a padding query attends to itself
alone (a row with every key masked would give NaN, which would reach the real rows through the
values of the next layer).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


class LayerCache:
    """One layer's view of the cache: `update` stores the new keys and values, returns all of them."""

    def __init__(self, cache: "KVCache", index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(self.index, k, v)


class KVCache:
    """Keys and values of `n_layers` layers for `batch` rows of up to `capacity` tokens. Not a
    dataclass on purpose: the sharding engine copies dataclass inputs to cast them."""

    def __init__(self, n_layers: int, batch: int, capacity: int, device: torch.device) -> None:
        self.batch, self.capacity, self.length = batch, capacity, 0
        self.keys: List[Optional[torch.Tensor]] = [None] * n_layers
        self.values: List[Optional[torch.Tensor]] = [None] * n_layers
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.seen = torch.zeros(batch, dtype=torch.long, device=device)  # real tokens per row so far
        self.layers = [LayerCache(self, i) for i in range(n_layers)]
        self.positions: Optional[torch.Tensor] = None  # (batch, new): rotary positions of the new tokens
        # (batch, 1, new, length + new): who attends to whom; None: every new token sees every cached one
        self.mask: Optional[torch.Tensor] = None
        self.padded: Optional[bool] = None  # whether the prompts were padded (set by the first extend)
        self._new = 0

    def extend(self, valid: torch.Tensor) -> None:
        """Announce the next forward's tokens: `valid` (batch, new), False for left padding."""
        new = valid.shape[1]
        start, end = self.length, self.length + new
        if end > self.capacity:
            raise ValueError(f"KVCache: {end} tokens do not fit its capacity of {self.capacity}")
        valid = valid.to(self.valid.device, torch.bool)
        self.valid[:, start:end] = valid
        self.positions = (self.seen[:, None] + valid.long().cumsum(1) - 1).clamp(min=0)
        self.seen += valid.long().sum(1)
        self._new = new
        if new == 1 and self.padded is False:  # one real token per row and no padding: it sees everything
            self.mask = None
            return
        if self.padded is None:  # the first extend: the prompts
            self.padded = not bool(valid.all())
        queries = torch.arange(start, end, device=valid.device)[:, None]
        keys = torch.arange(end, device=valid.device)[None, :]
        mask = (keys <= queries)[None] & self.valid[:, None, :end]
        mask |= (keys == queries)[None]  # a padding query attends to itself alone ([Note: the Llama KV cache])
        self.mask = mask[:, None]

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write layer `index`'s keys and values of the new tokens (batch, new, heads, head_dim);
        return the layer's keys and values of every token so far."""
        start, end = self.length, self.length + self._new
        if self.keys[index] is None:
            shape = (self.batch, self.capacity, k.shape[2], k.shape[3])
            self.keys[index] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[index] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.keys[index][:, start:end] = k
        self.values[index][:, start:end] = v
        return self.keys[index][:, :end], self.values[index][:, :end]

    def advance(self) -> None:
        """The forward announced by `extend` ran: its tokens are now in the cache."""
        self.length += self._new
        self._new = 0
