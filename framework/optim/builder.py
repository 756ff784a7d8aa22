"""Optimizer and schedule construction.

[Note: what weight decay leaves alone]
Weight decay pulls weights towards zero; it is not applied to a norm's scale and shift, to an
embedding table, to biases, or to any other parameter of fewer than 2 dimensions (a gain, a
scalar), as most language-model recipes do. What a parameter *is* decides, not its name: a name
marker ("norm", "bias", "embeddings") misses GPT-2's `ln_1`, BERT's `LayerNorm`, Llama's
`embed_tokens` and NeoX's `embed_in`. So the decision reads the module tree: the parameters of a
module that is a norm (torch's norm classes, or any class whose name ends in "Norm": RMSNorm,
T5LayerNorm, GemmaRMSNorm ...) or an embedding (`nn.Embedding` and its subclasses), every
parameter registered as `bias`, and every parameter whose shape has fewer than 2 dims. It is taken
on the model as built, before parallelism: the engine shards a matrix into 1-D pieces (so `ndim`
there says nothing) and tensor parallel turns parameters into DTensors, while names stay the same
(`build_optimizer` checks that they did). A parameter shared by two modules (a head tied to the
embedding) is left undecayed if either module says so.
"""

from __future__ import annotations

import math
import re
from typing import Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from framework.config.schema import OptimizerConfig, OptimizerName, Schedule

# torch's own norm layers (BatchNorm's and InstanceNorm's class names end in "Norm1d" etc.)
_TORCH_NORMS = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def _undecayed_module(module: nn.Module) -> bool:
    """A norm or an embedding: see [Note: what weight decay leaves alone]."""
    norm = isinstance(module, _TORCH_NORMS) or type(module).__name__.endswith("Norm")
    return norm or isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def no_decay_names(model: nn.Module) -> Set[str]:
    """Every name (tied parameters have several) of the parameters of `model` that weight decay
    leaves alone ([Note: what weight decay leaves alone]). Call it on the model as built, before
    parallelism changes its parameters' shapes."""
    names_of: dict = {}
    undecayed: set = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        by_module = _undecayed_module(module)
        for short, param in module.named_parameters(recurse=False):
            names_of.setdefault(id(param), set()).add(f"{prefix}.{short}" if prefix else short)
            if by_module or short == "bias" or param.dim() < 2:
                undecayed.add(id(param))
    return {name for key in undecayed for name in names_of[key]}


def hidden_matrix_names(model: nn.Module) -> Set[str]:
    """The names of the matrices Muon steps ([Note: Muon on sharded matrices]): every parameter of
    2 or more dimensions that weight decay does not leave alone (so no embedding, norm or bias:
    [Note: what weight decay leaves alone]) and that is not an output head: a linear layer outside
    the repeated blocks (no layer index in its name) with as many outputs as an embedding table
    has rows (a head tied to the embedding is the embedding). Stacked experts (3-D) are each
    expert's matrix. Call it on the model as built."""
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {
        id(m.weight)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.out_features in vocab and not _BLOCK_INDEX.search(f".{name}.")
    }
    undecayed = no_decay_names(model)
    return {
        name
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.dim() >= 2 and name not in undecayed and id(p) not in heads
    }


_BLOCK_INDEX = re.compile(r"\.\d+\.")  # a module inside a ModuleList of blocks: layers.3.mlp


def _param_groups(named: Iterable[Tuple[str, nn.Parameter]], weight_decay: float, undecayed: Set[str]) -> List[dict]:
    decay, plain, seen = [], [], set()
    for name, param in named:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (plain if name in undecayed else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, undecayed: Optional[Set[str]] = None, hidden: Optional[Set[str]] = None
) -> torch.optim.Optimizer:
    """`undecayed` / `hidden`: `no_decay_names` / `hidden_matrix_names` of the model as built, when
    `model` has been parallelized since; None: taken from `model` itself (a model as built)."""
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
        )
    groups = _param_groups(model.named_parameters(), cfg.weight_decay, undecayed)
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
