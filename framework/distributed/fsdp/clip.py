"""Gradient clipping over sharded gradients.

torch's own `torch.nn.utils.clip_grad_norm_` is right on our parameters, unmodified: their
gradients are `ShardPiece`s whose norms are partial until summed over the ranks ([Note: pieces
that describe themselves] in views.py). `clip_grad_norm_` below is the engine's spelling of the
same computation (one all-reduce of the summed powers), kept for scripts that import it.
Tested against a single-process reference in tests/distributed/test_fsdp2_behaviours.py
(`torch_clip_grad_norm`).
"""

from __future__ import annotations

from typing import Iterable, List, Tuple, Union

import torch
import torch.distributed as dist

from . import collectives as C
from .views import ShardPiece


def _global_norm(pieces: List[Tuple[torch.Tensor, int]], norm_type: float) -> torch.Tensor:
    """The norm over every rank of the gradient `pieces`, each (local gradient, number of ranks
    holding an identical copy of it). Collective; float64, on the first piece's device."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = pieces[0][0].device if pieces else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64, device=device)
    inf = norm_type == float("inf")
    for g, share in pieces:
        g = (g.to_local() if isinstance(g, ShardPiece) else g).detach()  # this rank's values
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
    if isinstance(param, ShardPiece):  # [Note: pieces that describe themselves] in views.py
        return param.piece_spec.copies
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
    [Note: pieces that describe themselves] in views.py).
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
