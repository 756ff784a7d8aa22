"""A mixture-of-experts model's routers in a pipeline (framework/routing.py's bookkeeping on the
stages of framework/distributed/pipeline.py).

[Note: routers in a pipeline]
A pipeline rank holds its stages' routers only, and so does every rank at the same pp index (its
stages' data-parallel, expert-parallel and tensor-parallel ranks). A router's loads over the
global batch are the sum over those ranks. `ScheduleSteps` keeps the whole model's routers in
model order (framework/steps.py's `schedule_for`, before the stages take the modules); a rank
counts the routers of its stages and zeros for the others, so one sum over all ranks gives every
router its own stage's ranks' total (and the step's statistics every router), for the
aux-loss-free bias (every copy of a router moves its bias alike) and for the global-batch shares.
The routing pass ahead of the step is `forward_only`: the step's
micro-batches through the stages, forward only and cut into the training step's microbatches
(the same rows, weights and operations, hence the same choices), each stage's routers counting
their slots; its outputs and load-balancing losses are dropped.

Tested: tests/models/test_moe_balance_pipeline.py (pp=2 and pp=2 x ep=2 with 1F1B, pp=2 with
interleaved 1F1B and zbv: equal to one process after 5 steps, losses, grad norms, weights and
biases within 1e-5).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from framework.config.pipeline import PipelineSchedule


@torch.no_grad()
def forward_only(pipe, batches: list, loss=None) -> None:
    """A forward-only pass of one training step's `batches` through `pipe` (a `Pipeline`), its
    outputs dropped: the task's rows, or a `RowsLoss`'s (`loss`). Through the schedule's
    forward-only step; zbv's schedule has none, so there each microbatch walks the stages in turn.
    Every rank of the pipeline calls it."""
    from framework.distributed.pipeline import _joined
    from framework.distributed.tensor_parallel import loss_context

    if loss is None:
        inputs, _, packed = _joined(batches)
    else:
        inputs, packed = loss.rows(batches, pipe.microbatches), {}
    with loss_context(pipe.model):
        if pipe.schedule_name == PipelineSchedule.zbv:
            chunks = zip(inputs.chunk(pipe.microbatches), *(v.chunk(pipe.microbatches) for v in packed.values()))
            for tokens, *extra in chunks:
                _walk(pipe, tokens, dict(zip(packed, extra)))
        else:
            pipe._microbatch_loss = lambda output, rows: output.new_zeros((), dtype=torch.float32)
            args = (inputs,) if pipe.holds_first else ()
            target = {"target": torch.arange(inputs.shape[0], device=inputs.device), "losses": []}
            pipe.schedule.eval(*args, **(target if pipe.holds_last else {}), **packed)
    pipe._clear_aux()  # the pass's load-balancing losses are no step's


def _walk(pipe, tokens: torch.Tensor, packed: dict) -> None:
    """Each stage in turn on its rank over one microbatch, the hidden states sent to the next
    stage's rank at the same place of the other dims."""
    peer = lambda r: dist.get_global_rank(pipe.pp_group, r)  # noqa: E731
    h = tokens
    for stage in range(pipe.n_stages):
        here, after = pipe.owner[stage], pipe.owner.get(stage + 1)
        if here == pipe.pp_rank:
            h = pipe.mine[stage](h, **packed)
            if after is not None and after != here:
                dist.send(h.detach().to(pipe.dtype).contiguous(), dst=peer(after), group=pipe.pp_group)
        elif after == pipe.pp_rank:
            h = torch.empty(*tokens.shape, pipe.mine[stage + 1].dim, dtype=pipe.dtype, device=tokens.device)
            dist.recv(h, src=peer(here), group=pipe.pp_group)
