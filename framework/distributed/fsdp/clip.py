"""Gradient clipping over sharded gradients."""

from __future__ import annotations

from typing import Iterable, Union

import torch
import torch.distributed as dist

from . import collectives as C
from .unit import owner_of


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip gradients of a model sharded with our `fully_shard` by their *global* norm.

    Use this instead of `torch.nn.utils.clip_grad_norm_`: the optimizer's parameters are this
    rank's local shards, so torch's version would compute a per-rank norm and clip each rank
    differently. Here every rank sums the `norm_type`-th powers of its local shard gradients
    (dividing by the number of identical copies of each piece in the world: the replicate degree,
    times the tensor-parallel degree for pieces not split by TP; the world size for parameters the
    engine does not shard), one all-reduce adds them up, and every rank scales
    its shards by the same factor. Returns the global total norm (same value on every rank).
    Collective: call it on every rank.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    norm_type = float(norm_type)
    device = params[0].grad.device if params else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    for p in params:
        g = p.grad.detach()
        if g.numel() == 0:
            continue
        if inf:
            acc = torch.maximum(acc, g.abs().max().double())
        else:
            owner = owner_of(p)  # [Note: records of sharded parameters] in unit.py
            share = owner[0].norm_share(owner[1]) if owner is not None else world
            acc += torch.linalg.vector_norm(g, norm_type).double().pow(norm_type) / share
    if world > 1:
        if dist.get_backend() == "nccl" and acc.device.type != "cuda":  # e.g. CPU-offloaded grads
            acc = acc.to(torch.device("cuda", torch.cuda.current_device()))
        if inf:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX)
        else:
            C.all_reduce_sum_(acc, None)
    total = acc if inf else acc.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total.float()
