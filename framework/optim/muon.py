"""Muon for the hidden matrices, AdamW for the rest, in one optimizer that also steps sharded models.

[Note: Muon on sharded matrices]
Muon (momentum, then each 2-D update orthogonalized by a few Newton-Schulz iterations) is the
update `torch.optim.Muon` makes on one device; `MuonAdamW` makes the same update, group by group,
on whole tensors and on our engine's pieces of sharded matrices alike. For the orthogonalization
it asks the pieces' own type for whole matrices (`type(p).map_whole(updates, fn)`, once per Muon
group, so over every matrix of the group at once: the engine gives each matrix one owner, balancing
the work over the ranks, and moves only the pieces the owner lacks, [Note: whole matrices from
pieces] in framework/distributed/fsdp/whole.py), so this file imports nothing of the engine. The
optimizer builder makes one Muon group, so the owners are balanced over the whole model. Groups with
`muon=True` hold the 2-D hidden matrices; the others (embeddings, norms, biases, the output head)
are stepped by torch's AdamW, which shares this optimizer's groups and state, so one scheduler,
one state dict and one checkpoint cover both. With `state_dtype=torch.bfloat16` the momentum
buffers and AdamW's moments are kept in bfloat16 ([Note: bf16 optimizer state and its rounding] in
framework/optim/lowp.py; the AdamW part is then `AdamWLowState`). Which matrix is which is decided by
`framework.optim.builder` from what the parameter is, never from a piece's own shape.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Tuple

import torch

from framework.optim.lowp import SALT_MOMENTUM, AdamWLowState, recast_state_, rounding_key, store_

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic iteration's published coefficients
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalize(
    m: torch.Tensor, coefficients: Tuple[float, float, float], steps: int, eps: float, dtype=torch.bfloat16
) -> torch.Tensor:
    """An approximately orthogonal matrix with `m`'s singular vectors: the quintic Newton-Schulz
    iteration X <- a X + (b A + c A^2) X with A = X X^T, from X = m / ||m||_F, on the wide
    orientation, in `dtype` (bfloat16: the arithmetic `torch.optim.Muon` does, so the two agree
    bit for bit on the same input)."""
    a, b, c = coefficients
    x = m.to(dtype)
    tall = m.size(0) > m.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def lr_scale(shape: torch.Size, rule: str) -> float:
    """How Muon's learning rate scales with a matrix's shape (A x B): "original" sqrt(max(1, A/B)),
    "match_rms_adamw" 0.2 sqrt(max(A, B)) (an update RMS like AdamW's, so AdamW's lr carries over).
    Stacked experts (E x A x B): each expert's matrix."""
    rows, cols = shape[-2], shape[-1]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def full_shape(p: torch.Tensor) -> torch.Size:
    """The shape the model computes with: a piece's description, else the tensor's own."""
    spec = getattr(p, "piece_spec", None)
    return spec.full_shape if spec is not None else p.shape


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon=True`, AdamW on the others (see the note at the top).

    Muon groups: lr, weight_decay (decoupled, lr x wd), momentum, nesterov, ns_steps,
    adjust_lr_fn ("original" | "match_rms_adamw"). AdamW groups: torch.optim.AdamW's settings.
    """

    def __init__(
        self,
        muon_groups: Iterable[dict],
        adamw_groups: Iterable[dict],
        *,
        adamw_defaults: dict,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        adjust_lr_fn: str = "original",
        ns_dtype: torch.dtype = torch.bfloat16,
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        muon_groups = [{**g, "muon": True} for g in muon_groups]
        adamw_groups = [{**g, "muon": False} for g in adamw_groups]
        self._adamw_defaults = dict(adamw_defaults)
        self.ns_dtype = ns_dtype  # the Newton-Schulz iteration's dtype (bfloat16, as torch's Muon)
        self.state_dtype, self.seed = state_dtype, seed  # the state's dtype between steps; rounding's seed
        defaults = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(muon_groups + adamw_groups, {**defaults, **adamw_defaults})
        for g in self.param_groups:
            if g["muon"]:
                for p in g["params"]:
                    if len(full_shape(p)) not in (2, 3):
                        shape = tuple(full_shape(p))
                        raise ValueError(f"Muon steps matrices (2-D, or stacked experts 3-D), not shape {shape}")
        self._link_adamw()

    def _link_adamw(self) -> None:
        """torch's AdamW over this optimizer's AdamW groups (the same dicts) and state."""
        groups = [g for g in self.param_groups if not g["muon"]]
        self._adamw = None
        if groups and any(g["params"] for g in groups):
            if self.state_dtype == torch.float32:
                adamw = torch.optim.AdamW([torch.zeros(1)], **self._adamw_defaults)
            else:  # moments in bfloat16: our AdamW (torch's keeps them in the parameter's dtype)
                defaults = {k: v for k, v in self._adamw_defaults.items() if k != "foreach"}
                adamw = AdamWLowState([torch.zeros(1)], **defaults, state_dtype=self.state_dtype, seed=self.seed)
            for g in groups:  # AdamW's own settings (amsgrad, maximize, ...) where a group lacks them
                for k, v in adamw.defaults.items():
                    g.setdefault(k, v)
            adamw.param_groups = groups
            adamw.state = self.state
            self._adamw = adamw

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.state_dtype != torch.float32:  # torch's load cast the state to the parameters' dtype
            recast_state_(self, ("momentum_buffer", "exp_avg", "exp_avg_sq"), self.state_dtype)
        self._link_adamw()  # the groups are new dicts now

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        m, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        updates: List[torch.Tensor] = []
        low = self.state_dtype != torch.float32
        slots = {id(p): i for i, p in enumerate(q for g in self.param_groups for q in g["params"])}
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, dtype=self.state_dtype if low else None)
                if low:  # the step count that keys its rounding
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            buf = state["momentum_buffer"]
            if low:  # [Note: bf16 optimizer state and its rounding]: updated in float32, stored rounded
                state["step"] += 1
                key = rounding_key(self.seed, state["step"], slots[id(p)], SALT_MOMENTUM)  # on its device
                buf32 = buf.to(torch.float32).lerp_(p.grad, 1 - m)
                store_(buf, buf32, key)
                buf = buf32
            else:
                buf.lerp_(p.grad, 1 - m)
            updates.append(p.grad.lerp(buf, m) if group["nesterov"] else buf)

        def ns(matrix: torch.Tensor) -> torch.Tensor:  # stacked experts: each expert's matrix on its own
            if matrix.dim() == 3:
                return torch.stack([ns(m) for m in matrix])
            return orthogonalize(matrix, NS_COEFFICIENTS, group["ns_steps"], NS_EPS, self.ns_dtype)

        map_whole = getattr(type(params[0]), "map_whole", None)
        if map_whole is not None:  # pieces of sharded matrices: the engine makes them whole
            ortho = map_whole(updates, ns)
        else:
            ortho = [ns(u) for u in updates]
        for p, o in zip(params, ortho):
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * lr_scale(full_shape(p), group["adjust_lr_fn"]))
