"""Optimizer and schedule construction. Which parameters weight decay leaves alone and which
matrices Muon steps is decided in framework/param_roles.py ([Note: what weight decay leaves
alone]), the rule the planner counts by too; `no_decay_names` and `hidden_matrix_names` are
re-exported here.
"""

from __future__ import annotations

import math
from typing import Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from framework.config.schema import OptimizerConfig, OptimizerName, Schedule
from framework.param_roles import hidden_matrix_names, no_decay_names  # noqa: F401  (re-exported)


def _param_groups(named: Iterable[Tuple[str, nn.Parameter]], weight_decay: float, undecayed: Set[str]) -> List[dict]:
    decay, plain, seen = [], [], set()
    for name, param in named:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (plain if name in undecayed else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module,
    cfg: OptimizerConfig,
    undecayed: Optional[Set[str]] = None,
    hidden: Optional[Set[str]] = None,
    seed: int = 0,
) -> torch.optim.Optimizer:
    """`undecayed` / `hidden`: `no_decay_names` / `hidden_matrix_names` of the model as built, when
    `model` has been parallelized since; None: taken from `model` itself (a model as built).
    `seed`: the job's, for bf16 state's rounding ([Note: bf16 optimizer state and its rounding])."""
    from framework.optim.lowp import STATE_DTYPES, AdamWLowState

    state_dtype = STATE_DTYPES[cfg.state_dtype]
    if undecayed is None:
        undecayed = no_decay_names(model)
    if hidden is None and cfg.name == OptimizerName.muon:
        hidden = hidden_matrix_names(model)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if not undecayed <= names:  # a bug: parallelism renamed parameters, decay would be misapplied
        raise RuntimeError(
            f"weight decay: parameters named before parallelism are missing after it: {sorted(undecayed - names)[:5]}"
        )
    if cfg.name == OptimizerName.muon:
        from framework.optim.muon import MuonAdamW

        named = [(n, p) for n, p in model.named_parameters() if n in hidden]
        rest = [(n, p) for n, p in model.named_parameters() if n not in hidden]
        return MuonAdamW(
            [{"params": [p for _, p in named if p.requires_grad], "lr": cfg.muon_lr, "weight_decay": cfg.weight_decay}],
            _param_groups(rest, cfg.weight_decay, undecayed),
            adamw_defaults={
                "lr": cfg.lr,
                "betas": (cfg.beta1, cfg.beta2),
                "eps": cfg.eps,
                "foreach": torch.cuda.is_available(),
            },
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn=cfg.muon_adjust_lr,
            state_dtype=state_dtype,
            seed=seed,
        )
    groups = _param_groups(model.named_parameters(), cfg.weight_decay, undecayed)
    if cfg.name == OptimizerName.adamw and state_dtype != torch.float32:  # moments in bfloat16: ours
        betas = (cfg.beta1, cfg.beta2)
        return AdamWLowState(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, state_dtype=state_dtype, seed=seed)
    if cfg.name == OptimizerName.adamw:
        # foreach=False on CPU: one kernel per parameter; the multi-tensor path groups tensors by
        # device and dtype and is no faster there. On a GPU, foreach=True: torch's own default
        # would take the for-loop form for our engine's parameters (it picks foreach for its own
        # tensor types only; docs/engine.md, "The optimizer sees flat pieces").
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            foreach=torch.cuda.is_available(),
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def lr_at(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """The multiplier of `cfg.lr` after `step` optimizer steps: linear warmup, then the schedule
    down to `min_lr_ratio` at `max_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == Schedule.constant:
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.schedule == Schedule.linear:
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, max_steps))
