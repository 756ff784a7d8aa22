"""The single-process optimizers the Muon parity tests compare with (test_muon_tp.py, test_muon_hf.py)."""

from __future__ import annotations

import torch


def reference_optimizers(model, cfg, ns_dtype: torch.dtype) -> list:
    """bfloat16: torch's own `torch.optim.Muon` on the matrices `build_optimizer` gives Muon and
    `torch.optim.AdamW` on the rest (decay and no-decay groups as ours); float32: our optimizer
    (`build_optimizer`) with the Newton-Schulz iteration in float32. `cfg`: an OptimizerConfig."""
    from framework.optim import build_optimizer, hidden_matrix_names, no_decay_names

    if ns_dtype != torch.bfloat16:
        opt = build_optimizer(model, cfg)
        opt.ns_dtype = ns_dtype
        return [opt]
    hidden, undecayed = hidden_matrix_names(model), no_decay_names(model)
    named = dict(model.named_parameters())
    rest = [k for k in named if k not in hidden]
    return [
        torch.optim.Muon(
            [named[k] for k in named if k in hidden],
            lr=cfg.muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum,
            nesterov=True,
        ),
        torch.optim.AdamW(
            [
                {"params": [named[k] for k in rest if k not in undecayed], "weight_decay": cfg.weight_decay},
                {"params": [named[k] for k in rest if k in undecayed], "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
        ),
    ]
