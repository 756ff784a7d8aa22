"""Context parallelism: each sequence split over `parallelism.cp` ranks, attention by all-to-all.

[Note: context parallelism by all-to-all]
The cp ranks of one data-parallel rank read the same micro-batch; rank i keeps tokens
[i s/cp, (i+1) s/cp) of every row (inputs and labels; packed documents' positions and ids stay
whole). Everything outside attention is per token, so it runs on the chunk as it is. Attention
needs every earlier token, so around it (DeepSpeed-Ulysses' exchange):

    q, k, v  (batch, s/cp, heads, d)  --all-to-all-->  (batch, s, heads/cp, d)
    rotary positions, the causal or per-document mask, attention: over the whole sequence
    out      (batch, s, heads/cp, d)  --all-to-all-->  (batch, s/cp, heads, d)  -> wo

Why this and not ring attention: each rank computes exact attention over the whole sequence for
its heads with the same kernel and the same mask as one process, so any mask (the fine-tuning
stage's block-diagonal documents) and any attention kernel work unchanged, there is no causal load
imbalance to chunk around, and the traffic per rank, 4 x (batch x s/cp x hidden) per block each
way, does not grow with cp. The price: cp must divide the heads (per tensor-parallel rank), and the
full sequence's attention scores for heads/cp heads live on one rank (ring attention would keep
only a block of them). KV heads that cp does not divide are repeated to the query heads first.

The loss: rank i sums the cross-entropy over its chunk's labelled tokens and divides by the
labelled tokens of the whole micro-batch (every cp rank can count them: it holds the labels),
times cp; the engine averages gradients over dp_shard x cp ranks, so the result is the mean over
the whole sequence's tokens, as one process computes it, however the labels fall into chunks. The
all-to-all's backward is the reverse all-to-all of the gradients.

The exchange is on only inside `active(model)` (the trainer's training and validation losses):
sampling and evaluation forwards outside it see whole sequences on every rank. The preference and
reward stages' losses are functions of whole sequences, not sums of per-token terms: see
[Note: sums over the chunks of a row].
"""

from __future__ import annotations

import contextlib
from typing import Any, Tuple

import torch
import torch.distributed as dist
from torch import nn

from framework.distributed.expert_parallel import AllToAllCounter
from framework.distributed.fsdp.collectives import all_gather_object_free, all_reduce_sum_

__all__ = [
    "apply_context_parallel",
    "SequenceExchange",
    "active",
    "active_as",
    "split_of",
    "split_batch",
    "sum_over_chunks",
    "gather_chunks",
]

_WHOLE = ("positions", "document_ids")  # per token of the whole row: kept whole on every cp rank


class SequenceExchange:
    """`sequence_exchange` of an attention module: see [Note: context parallelism by all-to-all]."""

    def __init__(self, group, size: int):
        self.group, self.size, self.active = group, size, False
        self.rank = dist.get_rank(group)  # which chunk of every row this rank holds

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, s/cp, heads, d) -> (batch, s, heads/cp, d)."""
        return _Exchange.apply(x, self, True)

    def to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, s, heads/cp, d) -> (batch, s/cp, heads, d)."""
        return _Exchange.apply(x, self, False)

    def move(self, x: torch.Tensor, to_heads: bool) -> torch.Tensor:
        n = self.size
        if to_heads:
            b, s, h, d = x.shape
            send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
        else:
            b, full, h, d = x.shape
            send = x.reshape(b, n, full // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)
        AllToAllCounter.bytes_sent += (n - 1) * send[0].numel() * send.element_size()
        AllToAllCounter.calls += 1
        if to_heads:  # got[i]: rank i's chunk of my heads
            return got.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)
        return got.permute(1, 2, 0, 3, 4).reshape(b, full // n, n * h, d)  # got[i]: my chunk, rank i's heads


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, exchange: SequenceExchange, to_heads: bool) -> torch.Tensor:
        ctx.exchange, ctx.to_heads = exchange, to_heads
        return exchange.move(x, to_heads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange.move(grad, not ctx.to_heads), None, None


def attention_modules(model: nn.Module) -> list:
    return [m for m in model.modules() if hasattr(m, "sequence_exchange")]


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Give every attention module of `model` (those with a `sequence_exchange` attribute, as
    framework.models.llama.model.Attention, or a transformers model's once its family readied it:
    framework/models/hf/context.py) the exchange over `cp_mesh`'s group."""
    from framework.errors import UserInputError

    modules = attention_modules(model)
    if not modules:
        raise UserInputError(
            f"parallelism.cp={cp_mesh.size()}: {type(model).__name__} has no attention that can split its "
            "sequence (our Llama family and model=hf's listed types can); set parallelism.cp=1"
        )
    exchange = SequenceExchange(cp_mesh.get_group(), cp_mesh.size())
    for module in modules:
        module.sequence_exchange = exchange
    model._framework_sequence_exchange = exchange  # what `active` switches, without walking the model


@contextlib.contextmanager
def active(model: nn.Module):
    """The attention modules exchange across the cp ranks inside this block only (a model
    `apply_context_parallel` did not split: nothing changes)."""
    exchange = getattr(model, "_framework_sequence_exchange", None)
    if exchange is None:
        yield
        return
    exchange.active = True
    try:
        yield
    finally:
        exchange.active = False


def split_of(model: nn.Module):
    """`model`'s SequenceExchange while it is on (inside `active`): its rows are split over the cp
    ranks; None otherwise (whole sequences)."""
    exchange = getattr(model, "_framework_sequence_exchange", None)
    return exchange if exchange is not None and exchange.active else None


@contextlib.contextmanager
def active_as(leader: nn.Module, model: nn.Module):
    """`model`'s exchange on while `leader`'s is (a frozen reference beside its policy)."""
    if split_of(leader) is None:
        yield
        return
    with active(model):
        yield


def sum_over_chunks(partial: torch.Tensor, exchange: SequenceExchange) -> torch.Tensor:
    """The sum over the cp ranks of each rank's `partial` (per row: its chunk's share of a
    per-sequence sum), the same on every cp rank; see [Note: sums over the chunks of a row]."""
    return _ChunkSum.apply(partial, exchange)


def gather_chunks(part: torch.Tensor, exchange: SequenceExchange) -> torch.Tensor:
    """(rows, s/cp) per-token values of this rank's chunk -> (rows, s), the whole rows (chunks in
    rank order, as `split_batch` cut them), the same on every cp rank; see [Note: sums over the
    chunks of a row]."""
    return _ChunkGather.apply(part, exchange)


# [Note: sums over the chunks of a row]
# A loss that is a function of whole-sequence quantities (DPO's summed reply log-probabilities,
# GRPO's per-completion token means) is computed the same on every cp rank from the chunks'
# shares: an all-reduce of per-row partial sums, or an all-gather of per-token values. Each cp rank
# then holds the same loss L, and the objective the ranks' backward passes add up is cp x L (their
# sum); the engine averages the gradients over the dp_shard x cp ranks, which leaves L's. So the
# backward of either collective is the sum over the cp ranks of the gradients arriving at its
# output (each rank's L pulls on every chunk): an all-reduce, then (the gather) this rank's chunk
# of it. Both run in the loss's dtype (fp32 or wider); the traffic is rows x s values per
# micro-batch at most, beside the all-to-all's 4 x rows x s/cp x hidden per block.


class _ChunkSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, exchange: SequenceExchange) -> torch.Tensor:
        ctx.exchange = exchange
        return all_reduce_sum_(partial.detach().clone(), exchange.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduce_sum_(grad.contiguous().clone(), ctx.exchange.group), None


class _ChunkGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, exchange: SequenceExchange) -> torch.Tensor:
        ctx.exchange = exchange
        rows, chunk = part.shape
        got = torch.empty((exchange.size * rows, chunk), dtype=part.dtype, device=part.device)
        all_gather_object_free(got, part.detach().contiguous(), exchange.group)  # rank-major
        return got.view(exchange.size, rows, chunk).permute(1, 0, 2).reshape(rows, exchange.size * chunk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = all_reduce_sum_(grad.contiguous().clone(), ctx.exchange.group)
        step = grad.shape[1] // ctx.exchange.size
        return grad[:, ctx.exchange.rank * step : (ctx.exchange.rank + 1) * step].contiguous(), None


def split_batch(batch: Any, rank: int, size: int, ignore_index: int) -> Tuple[Any, torch.Tensor]:
    """(this rank's chunk of a causal-LM batch, the labelled tokens of the whole batch, those not
    `ignore_index`): the inputs and labels cut on the sequence dim, positions and document ids
    kept whole."""

    def chunk(t: torch.Tensor) -> torch.Tensor:
        step = t.shape[1] // size
        return t[:, rank * step : (rank + 1) * step]

    if isinstance(batch, dict):
        labels = batch["labels"]
        part = {k: (v if k in _WHOLE else chunk(v)) for k, v in batch.items()}
    else:
        inputs, labels = batch
        part = (chunk(inputs), chunk(labels))
    return part, (labels != ignore_index).sum()
