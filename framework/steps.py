"""The step runners: how one optimizer step's micro-batches go forward and backward on the job's
layout, chosen once by `build_job` (framework/job.py), so the trainer and the stages never ask
which layout they run on.

- `PlainSteps`: every rank holds its shards of the whole model (sharded data parallel, tensor,
  context and expert parallel): each micro-batch's loss and backward in turn, gradients
  synchronised on the last, a mixture-of-experts model's routers around them (framework/routing.py).
- `ScheduleSteps`: the model cut into stages over `parallelism.pp` (framework/distributed/pipeline.py):
  the step's micro-batches through torch's schedule at once, its loss the task's cross-entropy on
  the last stage, or a stage's own `RowsLoss` (stage=dpo's pairs, stage=grpo's rollouts) that the
  stage gives as its micro-batch loss (pipelines train causal language models, pre-training,
  fine-tuning, preference pairs or GRPO: refused otherwise at the build); the routers' statistics
  summed over the stages' ranks.

Both return the step's loss summed over this rank's micro-batches (each divided by their number),
on the device; the trainer owns what follows (clip, observe, optimizer step, zero_grad).
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from framework.distributed.tensor_parallel import full, loss_context
from framework.models.tasks import IGNORE_INDEX, to_device, with_aux_loss
from framework.routing import RouterSteps


class RowsLoss:
    """A stage's loss as a pipeline's last stage computes it, microbatch by microbatch: [Note: a
    stage's own loss through the schedule] in framework/distributed/pipeline.py. A stage hands it
    to `ScheduleSteps` where `PlainSteps` takes its `loss(batch)`."""

    def rows(self, batches: list, microbatches: int) -> torch.Tensor:
        """The step's `batches` as the stages' input rows, cut by the schedule into `microbatches`
        equal chunks in order; keeps what `__call__` needs. Every rank of the pipeline calls it."""
        raise NotImplementedError

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The mean loss of a microbatch, on the last stage: `output` the stage's of the rows whose
        indices (into `rows(...)`'s) are `rows`."""
        raise NotImplementedError


class PlainSteps:
    whole_model = True  # each rank runs the whole model's forward: generation, a task's metrics

    def __init__(self, model, dims, mesh):
        self.model, self.dims, self.mesh = model, dims, mesh
        self.routers = RouterSteps.of(model)  # a mixture-of-experts model's, around each step
        self._routed = False

    def sequences_split(self):
        """Under context parallelism each rank's chunk of every row ([Note: context parallelism by all-to-all])."""
        if self.dims.cp == 1:
            return contextlib.nullcontext()
        from framework.distributed.context_parallel import active

        return active(self.model)

    def task_loss(self, task) -> Callable:
        """batch -> the task's loss; under context parallelism this rank's share of it, from its
        chunk of every row (see [Note: context parallelism by all-to-all])."""
        cp, model = self.dims.cp, self.model
        if cp == 1:
            return lambda batch: task.loss(model, batch)
        from framework.distributed.context_parallel import split_batch

        def loss(batch):
            part, labelled = split_batch(batch, self.mesh.get_local_rank("cp"), cp, IGNORE_INDEX)
            return with_aux_loss(model, task.summed_loss(model, part) * cp / labelled.clamp(min=1))

        return loss

    def forward_backward(self, next_batch: Callable, accum: int, loss: Callable, device, routed: bool = True):
        """`accum` micro-batches from `next_batch()` (on the device), each's `loss(batch) / accum`
        backward; `routed`: the routers count and balance them ([Note: global-batch load balancing])."""
        model = self.model
        total = torch.zeros((), device=device)
        ahead: List = []  # the step's micro-batches, when the routers route them first
        self._routed = routed and self.routers is not None
        if self._routed:
            if self.routers.routes_ahead:
                ahead = [next_batch() for _ in range(accum)]
            with loss_context(model), self.sequences_split():
                self.routers.begin(ahead, loss)
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            batch = ahead[micro] if ahead else next_batch()
            with loss_context(model), self.sequences_split():  # tensor / context parallel
                part = loss(batch) / accum
                part.backward()
            total += full(part.detach())
        return total

    def end(self, read: bool) -> dict:
        """After the step's backward passes: the routers' bias update and, with `read`, their statistics."""
        if not self._routed:
            return {}
        self._routed = False
        return self.routers.end(read, copies=self.dims.tp)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The model's logits of `tokens` (float32, whole over tensor parallel) on every rank."""
        out = self.model(tokens)
        return full(getattr(out, "logits", out)).float()

    @torch.no_grad()
    def eval_total(self, batches: list, per_step: int, loss: Callable, device):
        """The sum of the batches' losses (no backward)."""
        total = torch.zeros((), device=device)
        for batch in batches:
            with loss_context(self.model), self.sequences_split():  # tensor / context parallel
                total += full(loss(to_device(batch, device)))
        return total


class ScheduleSteps:
    whole_model = False  # each rank holds its stages only

    def __init__(self, schedule, routers: Optional[RouterSteps] = None, tp: int = 1):
        self.schedule, self.model, self.tp = schedule, schedule.model, tp
        # the whole model's routers, in model order: this rank's stages count theirs, the
        # statistics sum every rank's (RouterSteps.end)
        self.routers, self._routed, self._device = routers, False, None

    def task_loss(self, task) -> Callable:
        return lambda batch: task.loss(self.model, batch)  # the schedule computes the loss itself

    def sequences_split(self):
        return contextlib.nullcontext()

    def forward_backward(self, next_batch: Callable, accum: int, loss: Callable, device, routed: bool = True):
        """Every micro-batch through the stages: one schedule step (its loss the task's
        cross-entropy, or `loss` where a stage gives a `RowsLoss`); `routed`: the routers count
        and balance them, as `PlainSteps`' do."""
        batches = [next_batch() for _ in range(accum)]
        self._routed, self._device = routed and self.routers is not None, device
        if self._routed:  # the routing pass ahead, through the stages: [Note: routers in a pipeline]
            from framework.distributed.pipeline_routing import forward_only

            step = lambda group: forward_only(self.schedule, group, _rows_loss(loss))  # noqa: E731
            self.routers.begin([batches], step, device)
        return self.schedule.train_batches(batches, _rows_loss(loss))

    def end(self, read: bool) -> dict:
        """The routers' bias update and, with `read`, statistics, of every stage (the load-balancing
        losses ride the stages' outputs: [Note: the load-balancing loss in a pipeline])."""
        if not self._routed:
            return {}
        self._routed = False
        return self.routers.end(read, self._device, copies=self.tp)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole model's logits on every rank, the stages run in turn outside the schedule."""
        return self.schedule.logits(tokens)

    def eval_total(self, batches: list, per_step: int, loss: Callable, device):
        """Forward-only passes of the schedule, `per_step` batches (a step's) each."""
        return self.schedule.eval_total([to_device(b, device) for b in batches], per_step, _rows_loss(loss))

    def forward_rows(self, inputs: torch.Tensor, on_output: Callable) -> None:
        """A forward-only pass of a `RowsLoss`'s rows (a reference model's: the pipeline's
        `forward_rows`); `on_output(output, rows)` on the last stage's rank."""
        self.schedule.forward_rows(inputs, on_output)


def _rows_loss(loss) -> Optional[RowsLoss]:
    return loss if isinstance(loss, RowsLoss) else None  # else the task's, computed by the schedule


def schedule_for(model, dims, mesh, cfg, family, device, accum: int, task) -> Optional[ScheduleSteps]:
    """`ScheduleSteps` over the model's stages when `parallelism.pp` > 1, else None (the plain loop)."""
    if dims.pp == 1:
        return None
    from framework.distributed.pipeline import Pipeline
    from framework.models.tasks import cross_entropy

    routers = RouterSteps.of(model)  # the whole model's, before the stages take its modules
    return ScheduleSteps(Pipeline(model, dims, mesh, cfg, family, device, accum, task, cross_entropy), routers, dims.tp)
