"""Optimizer state in bfloat16 (`optimizer.state_dtype=bf16`): half the bytes of Adam's moments and
Muon's momentum, kept on track by stochastic rounding.

[Note: bf16 optimizer state and its rounding]
The state is kept in bfloat16 between steps; each step reads it into float32, updates it there
with the float32 gradient, computes the parameter update from those float32 values, and writes the
state back to bfloat16 with *stochastic* rounding: a value between two bf16 neighbours becomes the
upper one with probability equal to its distance from the lower one (in units of the gap), so
the stored state is unbiased. Round-to-nearest is not: an exponential average's step
(1 - beta) (x - v) smaller than half a bf16 gap (2^-9 to 2^-8 of v) is lost every time. With
beta2 = 0.999 that is any |x - v| under 1.95 v or more: the second moment can never decrease
(x >= 0) and grows only on a squared gradient above ~3 v; tests/unit/test_optim_state_dtype.py shows such an
average stuck where float32's moves, and this rounding following it. With our defaults (beta1 0.9,
beta2 0.95, Muon's momentum 0.95) nearest rounding loses steps under 2-8% of the value, a bias
that grows as gradients change slowly; stochastic rounding is used for every write, at every
beta, because it keeps all of them unbiased. Kahan-style compensation would track as well, but
it keeps a second bf16 tensor per state, which is the saving given back; stochastic rounding
costs no bytes.

Its random bits are not drawn from a generator: they are a hash of (the job's seed, the
parameter's step count, the tensor's slot in the optimizer, which state it is, and the float32
value's own 32 bits). So a rounding depends on nothing a rank owns: the same element rounds the
same way whichever rank holds it, at any world size or shard-boundary policy, and a resumed job
(whose state and step counts come from the checkpoint) repeats the run it continues bit for bit.
Over steps the hash's input changes with the step count, so the decisions for a fixed value are
independent draws, which is what makes the rounding unbiased. The price of reading the value's
bits: two runs whose values differ in the last fp32 bit (another world size sums gradients in
another order) draw other roundings for them, so such runs part by whole bf16 gaps in a few
elements (measured in tests/integration/test_state_dtype.py: under 1e-4 in the loss after 10 steps).
"""

from __future__ import annotations

import math
from typing import Dict

import torch

STATE_DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}

_MASK32 = 0xFFFFFFFF
_HIGH16 = 0xFFFF0000
_MIX = 0x45D9F3B  # the multiplier of a well-mixing 32-bit integer hash (two rounds)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def rounding_key(seed: int, step: int, slot: int, salt: int) -> int:
    """The 32-bit key of one tensor's rounding at one step: [Note: bf16 optimizer state and its rounding]."""
    x = 0
    for part in (seed, step, slot, salt):
        x = _splitmix64(x ^ (part & 0xFFFFFFFFFFFFFFFF))
    return x & _MASK32


def stochastic_round_bf16(x: torch.Tensor, key: int) -> torch.Tensor:
    """`x` (float32) rounded to bfloat16 stochastically, with bits hashed from `key` and each
    value's own bits (deterministic; [Note: bf16 optimizer state and its rounding]). Infinities
    and NaNs stay as they are."""
    x = x.to(torch.float32)
    bits = x.view(torch.int32).to(torch.int64) & _MASK32  # the float's bits, unsigned
    h = bits ^ key
    h = (((h >> 16) ^ h) * _MIX) & _MASK32
    h = (((h >> 16) ^ h) * _MIX) & _MASK32
    noise = ((h >> 16) ^ h) & 0xFFFF
    # adding up to one bf16 gap to the magnitude bits and cutting the low 16 bits rounds the
    # magnitude up with probability (low 16 bits) / 2^16 (the sign bit is not reached by finite values)
    rounded = (bits + noise) & _HIGH16
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def store_(state: torch.Tensor, value: torch.Tensor, key: int) -> None:
    """Write float32 `value` into the state tensor `state`: a plain copy when the state is float32,
    stochastically rounded when it is bfloat16."""
    if state.dtype == torch.float32:
        state.copy_(value)
    else:
        state.copy_(stochastic_round_bf16(value, key))


def recast_state_(optimizer: torch.optim.Optimizer, keys, dtype: torch.dtype) -> None:
    """Put the named state tensors back in `dtype` after `load_state_dict` (torch's casts every
    floating state to its parameter's dtype; bf16 state held as float32 converts back exactly)."""
    for st in optimizer.state.values():
        for k in keys:
            v = st.get(k)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
                st[k] = v.to(dtype)


# salts: which state a rounding is for
SALT_EXP_AVG, SALT_EXP_AVG_SQ, SALT_MOMENTUM = 1, 2, 3


class AdamWLowState(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments: torch.optim.AdamW's update) with its
    moments `exp_avg` / `exp_avg_sq` held in `state_dtype` (bfloat16) and `step` a float32 scalar,
    as torch's; [Note: bf16 optimizer state and its rounding]. Steps whole tensors, and our
    engine's pieces alike (every operation is elementwise)."""

    # Every operation is elementwise and takes no norm: our engine may step it on the plain local
    # data ([Note: the optimizer step on plain local data] in framework/distributed/fsdp/optim_check.py).
    elementwise_step = True

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        # torch's AdamW's settings, so that the param groups (which a resume compares with the
        # checkpoint's) have the same keys with either state dtype; amsgrad, maximize and the
        # fused/foreach/capturable forms stay off (the builder sets none of them)
        like = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, like.defaults)
        self.state_dtype = state_dtype
        self.seed = seed

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        recast_state_(self, ("exp_avg", "exp_avg_sq"), self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        slot = -1
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            if group.get("amsgrad") or group.get("maximize"):
                raise NotImplementedError("AdamWLowState: amsgrad and maximize are not implemented")
            for p in group["params"]:
                slot += 1  # the parameter's place in the groups: the same on every rank
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, dtype=self.state_dtype, memory_format=torch.preserve_format
                    )
                state["step"] += 1
                n = int(state["step"].item())
                grad = p.grad.to(torch.float32)
                m = state["exp_avg"].to(torch.float32).lerp_(grad, 1 - b1)
                v = state["exp_avg_sq"].to(torch.float32).mul_(b2).addcmul_(grad, grad, value=1 - b2)
                p.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2**n)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1**n))
                store_(state["exp_avg"], m, rounding_key(self.seed, n, slot, SALT_EXP_AVG))
                store_(state["exp_avg_sq"], v, rounding_key(self.seed, n, slot, SALT_EXP_AVG_SQ))
        return loss
