"""Expert parallelism: each mixture-of-experts block's experts split over `parallelism.ep` ranks,
tokens sent to the rank holding their expert and back by all-to-all.

[Note: the layout of expert parallelism]
The ep ranks are neighbours among the dp_shard ranks (`framework.config.degrees`): with 4 ranks
and ep=2, ranks {0, 1} and {2, 3} each hold every expert once (rank 0 and 2 the first half, 1 and
3 the second), and each expert is sharded by the engine over the `efsdp = dp_shard / ep` ranks
holding it ({0, 2} and {1, 3}). Every rank still reads its own samples (data parallel over all
dp_shard ranks) and keeps the rest of the model sharded over all of them.

Under hybrid sharding (dp_replicate > 1) every replica is laid out so within its own dp_shard
ranks: with 4 ranks, dp_replicate=2, dp_shard=2 and ep=2, ranks {0, 1} and {2, 3} are the ep
groups, and the experts' engine mesh is 2-D (dp_replicate, efsdp) = ({0, 2}, {1, 3}) x 1: each
expert sharded over efsdp within its replica, its gradient all-reduced over the replicas, as the
dense units' over (dp_replicate, dp_shard).

Under context parallelism (cp > 1) the ep groups are still dp_shard neighbours, one per cp rank:
with 4 ranks, dp_shard=2, cp=2 and ep=2 (mesh dp_shard x cp), ranks {0, 2} and {1, 3} exchange
tokens (each holding a different chunk of the same sequences), and each expert is sharded by the
engine over its efsdp x cp ranks ({0, 1} and {2, 3}), the cp ranks being data-parallel ranks for
the weights; the divide factor is dp x cp, the dense units' ([Note: context parallelism by
all-to-all]). The tokens of one sequence are routed on the ranks holding them, per token as on one
process: the load-balancing shares of a micro-batch are then the global batch's
(aux_loss_scope=global_batch) and the capacity unlimited; the other settings are refused with cp.

Under tensor parallelism every tp rank holds the same experts and routes the same tokens: the ep
groups and the efsdp ranks are those of one tp index ([Note: experts under tensor parallelism],
framework/models/llama/parallelize.py, says why experts are not split over tp).

A model opts in by giving each group of experts the shape of `framework.models.llama.moe.Experts`:
stacked tensors with the expert on dim 0 (every tensor the module itself holds) and a `dispatch`
attribute, which the module calls with the rows of each expert and a function from the rows per
held expert to their outputs (transformers' experts: framework/models/hf/moe.py).
`apply_expert_parallel` replaces each tensor with a DTensor holding this rank's slice (`Shard(0)`
on the ep mesh; sliced from the full value every rank built with the same seed, so the numbers do
not depend on the layout), and sets `dispatch`.

One step of a block, on every rank of an ep group, for its own tokens:
  1. the router picks experts (as without ep); the rows for expert e are grouped by e, which
     groups them by destination rank (experts are held in order);
  2. an all-to-all of the row counts (n_experts integers), then one all-to-all of the rows;
  3. the rank computes its experts on the rows from every rank (zero rows is a valid batch, so
     every rank runs the same operations and an expert no token chose gets a zero gradient);
  4. the reverse all-to-all brings each row's output home, where it is weighted and summed.
The all-to-all's backward is the reverse all-to-all of the gradients, so each expert's gradient
sums the contributions of the ep group's tokens.

Gradient scale: the loss is the mean over all dp ranks' samples, so every gradient is a sum over
the ranks divided by dp. The engine's reduction over the efsdp ranks holding an expert adds the
other groups' contributions; its divide factor is set to dp (not efsdp) so the expert gradients
come out on the same scale as the others (`set_gradient_divide_factor`). Gradient clipping counts
each expert piece once (it is split, not replicated, over the ep ranks).

Checkpoints hold the experts as whole (n_experts, ...) tensors in DCP, so a job resumes with any
ep (and any dp) that divides them, as across tp.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from framework.errors import UserInputError

__all__ = ["apply_expert_parallel", "expert_groups", "AllToAllCounter"]


def expert_groups(model: nn.Module) -> List[nn.Module]:
    """The modules holding stacked experts (see [Note: the layout of expert parallelism])."""
    return [
        m for m in model.modules() if hasattr(m, "dispatch") and next(m.parameters(recurse=False), None) is not None
    ]


class AllToAllCounter:
    """Bytes this rank sent to the other ranks by the model's own all-to-alls (expert parallelism's
    counts, rows and their gradients; context parallelism's q/k/v and outputs), and the exchanges
    issued: the trainer's `comm_bytes` adds them."""

    bytes_sent = 0
    calls = 0

    @classmethod
    def reset(cls) -> None:
        cls.bytes_sent = cls.calls = 0


class _AllToAll(torch.autograd.Function):
    """Rows `x` split by `in_splits` to the group's ranks; `out_splits` rows come from each.
    Backward: the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    me = dist.get_rank(group)
    row = math.prod(x.shape[1:]) * x.element_size()  # x may have no rows: a rank no token was sent to
    AllToAllCounter.bytes_sent += (sum(in_splits) - in_splits[me]) * row
    AllToAllCounter.calls += 1
    return out


class ExpertDispatch:
    """`dispatch` of one group of experts: see [Note: the layout of expert parallelism]."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, rows: Sequence[torch.Tensor], experts: nn.Module) -> List[torch.Tensor]:
        n, ep = len(rows), self.size
        held = n // ep
        counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64, device=rows[0].device)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts, group=self.group)  # [source, held expert]
        AllToAllCounter.bytes_sent += (ep - 1) * held * counts.element_size()
        AllToAllCounter.calls += 1
        counts_l, incoming_l = counts.tolist(), incoming.tolist()
        send = [sum(counts_l[d * held : (d + 1) * held]) for d in range(ep)]
        recv = [sum(incoming_l[s * held : (s + 1) * held]) for s in range(ep)]
        arrived = _AllToAll.apply(torch.cat(list(rows)), recv, send, self.group)
        pieces = arrived.split(incoming_l)  # source-major, held-expert-minor
        per_expert = [torch.cat([pieces[s * held + j] for s in range(ep)]) for j in range(held)]
        outputs = experts(per_expert)
        by_source = [y.split([incoming_l[s * held + j] for s in range(ep)]) for j, y in enumerate(outputs)]
        back = torch.cat([by_source[j][s] for s in range(ep) for j in range(held)])
        returned = _AllToAll.apply(back, send, recv, self.group)
        return list(returned.split(counts_l))


def apply_expert_parallel(
    model: nn.Module,
    ep: int,
    efsdp: int,
    device_type: str,
    dp_replicate: int = 1,
    cp: int = 1,
    tp: int = 1,
    pp: int = 1,
):
    """Split every group of experts in `model` over `ep` neighbouring ranks; returns the groups and
    the mesh of the ranks holding the same experts (the engine shards them over it): 1-D (efsdp),
    or 2-D (dp_replicate, efsdp) under hybrid sharding, the experts sharded within each replica
    and their gradients averaged over the replicas; with context parallelism the efsdp x cp ranks
    flattened ([Note: the layout of expert parallelism]). Under a pipeline (`pp`, the outermost
    dimension) `model` is this rank's stages and all of it lies within one pp index."""
    from framework.distributed.groups import init_mesh

    groups = expert_groups(model)
    if not groups and pp > 1:
        raise UserInputError(
            f"parallelism.ep={ep} with parallelism.pp={pp}: this rank's stages hold no mixture-of-experts "
            "block (dense blocks only, as DeepSeek-V3's first_k_dense_replace first ones); give every stage one "
            "with parallelism.pp_split, or set parallelism.ep=1"
        )
    if not groups:
        raise UserInputError(
            f"parallelism.ep={ep}: the model has no mixture-of-experts blocks to split; set parallelism.ep=1"
        )
    mesh = init_mesh(
        device_type,
        (pp, dp_replicate, efsdp, ep, cp, tp),
        mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "cp", "tp"),
    )
    ep_mesh = mesh["ep"]
    me = ep_mesh.get_local_rank()
    for module in groups:
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise UserInputError(
                    f"parallelism.ep={ep} does not divide the {param.shape[0]} experts of {name}; "
                    "choose an ep that divides them"
                )
            step = param.shape[0] // ep
            local = param.detach()[me * step : (me + 1) * step].clone()
            split = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            setattr(module, name, nn.Parameter(split, requires_grad=param.requires_grad))
        module.dispatch = ExpertDispatch(ep_mesh.get_group(), ep)
    if cp > 1:  # the cp ranks of a data-parallel rank hold the same experts: they shard them too
        from framework.distributed.groups import flatten

        return groups, flatten(mesh["efsdp", "cp"], "efsdp_cp")
    return groups, mesh["dp_replicate", "efsdp"] if dp_replicate > 1 else mesh["efsdp"]
