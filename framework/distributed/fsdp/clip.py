"""Gradient clipping over sharded gradients: ours, and torch's `clip_grad_norm_` made right.

[Note: torch's clip_grad_norm_ on sharded parameters]
The optimizer's parameters are this rank's local pieces, so a norm of their gradients is a
per-rank norm: torch's `clip_grad_norm_` would return it and clip each rank by a different
factor, a silent wrong result. Users call torch's function (a training script written for DDP or
FSDP2, torchtitan-style loops), often through a name imported before our engine was. So on the
first `fully_shard`, `install_torch_norm` wraps the function torch's clipping computes its total
norm with (`torch.nn.utils.clip_grad._get_total_norm`, which `clip_grad_norm_` looks up when
called, and its public alias `torch.nn.utils.get_total_norm`): when any gradient it is given is
the `.grad` of a parameter our engine sharded (looked up when the norm is asked for, from the
engine's records of its parameters, so the step itself does no extra work), the norm is the
global one, computed as `clip_grad_norm_` below does (collective: every rank calls it, as every
rank calls clipping); otherwise torch's own runs unchanged. torch then scales each local piece by the global factor,
which is the right clipping. Tested against a single-process reference in
tests/distributed/test_fsdp2_behaviours.py (`torch_clip_grad_norm`).
"""

from __future__ import annotations

import functools
from typing import Iterable, List, Tuple, Union

import torch
import torch.distributed as dist

from . import collectives as C
from .unit import owner_of, sharded_parameters


def _global_norm(pieces: List[Tuple[torch.Tensor, int]], norm_type: float) -> torch.Tensor:
    """The norm over every rank of the gradient `pieces`, each (local gradient, number of ranks
    holding an identical copy of it). Collective; float64, on the first piece's device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = pieces[0][0].device if pieces else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    for g, share in pieces:
        g = g.detach()
        if g.numel() == 0:
            continue
        if inf:
            acc = torch.maximum(acc, g.abs().max().double().to(device))
        else:
            acc += torch.linalg.vector_norm(g, norm_type).double().pow(norm_type).to(device) / share
    if world > 1:
        if dist.get_backend() == "nccl" and acc.device.type != "cuda":  # e.g. CPU-offloaded grads
            acc = acc.to(torch.device("cuda", torch.cuda.current_device()))
        if inf:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX)
        else:
            C.all_reduce_sum_(acc, None)
    return acc if inf else acc.pow(1.0 / norm_type)


def _share(param: torch.Tensor) -> int:
    """Ranks holding an identical copy of `param`'s local piece: see `clip_grad_norm_`."""
    owner = owner_of(param)  # [Note: records of sharded parameters] in unit.py
    if owner is not None:
        return owner[0].norm_share(owner[1])
    return dist.get_world_size() if dist.is_initialized() else 1


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients of a model sharded with our `fully_shard` by their *global* norm.

    Every rank sums the `norm_type`-th powers of its local shard gradients (dividing by the number
    of identical copies of each piece in the world: the replicate degree, times the
    tensor-parallel degree for pieces not split by TP; the world size for parameters the engine
    does not shard), one all-reduce adds them up, and every rank scales its shards by the same
    factor. Returns the global total norm (same value on every rank). Collective: call it on every
    rank. torch's `torch.nn.utils.clip_grad_norm_` gives the same result on our parameters (see
    [Note: torch's clip_grad_norm_ on sharded parameters]).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    total = _global_norm([(p.grad, _share(p)) for p in params], float(norm_type))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total.float()


def _sharded_norm(torch_norm):
    """torch's total-norm function, answering with the global norm for our gradients."""

    @functools.wraps(torch_norm)
    @torch.no_grad()
    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        grads = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        ours = {id(p.grad): p for p in sharded_parameters() if p.grad is not None}
        owners = [ours.get(id(g)) for g in grads]
        if all(p is None for p in owners):
            return torch_norm(grads, norm_type, error_if_nonfinite, foreach)
        world = dist.get_world_size() if dist.is_initialized() else 1
        pieces = [(g, _share(p) if p is not None else world) for g, p in zip(grads, owners)]
        total = _global_norm(pieces, float(norm_type)).to(grads[0].dtype)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        return total

    total_norm._sharded_norm = True  # installed once
    return total_norm


def install_torch_norm() -> None:
    """Make torch's gradient-norm functions right on our parameters (see the note at the top).
    Idempotent; called by `fully_shard`."""
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    current = getattr(clip_grad, "_get_total_norm", None)
    if current is None:  # a torch without it: fail loudly rather than clip by a per-rank norm
        raise RuntimeError(
            "this torch has no torch.nn.utils.clip_grad._get_total_norm: torch's clip_grad_norm_ would clip our "
            "sharded parameters by a per-rank norm; use framework.distributed.fsdp.clip_grad_norm_"
        )
    if getattr(current, "_sharded_norm", False):
        return
    wrapped = _sharded_norm(current)
    clip_grad._get_total_norm = wrapped
    if getattr(utils, "get_total_norm", None) is current:
        utils.get_total_norm = wrapped
