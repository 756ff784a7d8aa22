"""The ZeRO paper's model-state formula (Rajbhandari et al. 2020, section 5 and Figure 1).

Mixed-precision Adam keeps, per parameter, 2 bytes of 16-bit parameters, 2 bytes of 16-bit
gradients and K = 12 bytes of optimizer state (fp32 master parameters, momentum, variance).
Stage 1 (P_os) shards the optimizer state over N_d data-parallel ranks, stage 2 (P_os+g) the
gradients too, stage 3 (P_os+g+p) the parameters too.
"""

from __future__ import annotations


def zero_model_state_bytes(
    params: float, dp: int, stage: int, k: float = 12.0, param_bytes: float = 2.0, grad_bytes: float = 2.0
) -> float:
    """Model-state bytes per rank: stage 0 (unsharded, DDP) to 3."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0, 1, 2 and 3")
    p = params * param_bytes / (dp if stage >= 3 else 1)
    g = params * grad_bytes / (dp if stage >= 2 else 1)
    o = params * k / (dp if stage >= 1 else 1)
    return p + g + o
