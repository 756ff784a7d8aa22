"""`trainer.deterministic=true`: a step whose losses, gradient norm and weights are bit for bit the
same whatever the number of ranks, the sharding strategy, dp_shard/dp_replicate and the
micro-batch split of the same global batch (docs/engine.md "Deterministic mode").

The step's global batch is cut into units of `trainer.deterministic_unit` samples, numbered in the
global data order; the loader hands each rank a run of consecutive units (rank-major), and every
unit is one forward and backward of its own, with the same inputs, the same gathered weights and
the same kernels wherever it runs. Its loss is the summed cross-entropy over the global batch's
labelled-token count (an exact integer, one all-reduce), so no division depends on the layout. The
engine adds the units' gradients in one fixed tree ([Note: one summation tree, whatever the
layout] in framework/distributed/fsdp/canonical.py), the reported loss and the gradient norm are
summed the same way, and each unit's randomness (dropout) is drawn from the seed and the unit's
global number. On CPU each rank computes with one intra-op thread: a sum's blocking follows the
thread count (measured: a 4M-element fp32 sum differs between 1 and 2 threads).
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from framework.data.loader import GlobalBatchLoader
from framework.distributed.fsdp.canonical import canonical_grad_norm_
from framework.distributed.fsdp.tree import tree_sum_slots
from framework.errors import UserInputError
from framework.models.tasks import IGNORE_INDEX, to_device
from framework.steps import PlainSteps


def _split(batch, unit: int) -> List:
    """A micro-batch cut into consecutive units of `unit` rows ((inputs, labels) or named tensors)."""
    if isinstance(batch, dict):
        rows = next(iter(batch.values())).shape[0]
        return [{k: v[i : i + unit] for k, v in batch.items()} for i in range(0, rows, unit)]
    return [tuple(t[i : i + unit] for t in batch) for i in range(0, batch[0].shape[0], unit)]


def _labelled(batch) -> int:
    labels = batch["labels"] if isinstance(batch, dict) else batch[1]
    return int((labels != IGNORE_INDEX).sum())


class DeterministicSteps:
    """The trainer's step under the mode (`Trainer.train_step` hands over to `train_step`)."""

    def __init__(self, trainer) -> None:
        t, job = trainer.cfg.trainer, trainer.job
        plain = isinstance(job.runner, PlainSteps)  # not a pipeline's schedule
        routers = job.runner.routers.routers if plain and job.runner.routers is not None else []
        balanced = any(not getattr(r, "counts_only", False) for r in routers)  # transformers': counts only
        if not plain or balanced or job.dims.tp > 1 or job.dims.cp > 1:
            raise UserInputError(
                "trainer.deterministic=true: this model or layout sums across ranks inside a unit "
                "(pipeline, tensor/context parallel, mixture-of-experts routers); see docs/engine.md"
            )
        if not hasattr(trainer.model, "set_deterministic_reduction"):
            raise UserInputError("trainer.deterministic=true needs parallelism.engine=native")
        if job.task.summed_loss is None:
            raise UserInputError(
                f"trainer.deterministic=true with model.task={job.task.name}: the mode normalises a summed "
                "loss by the global batch's labelled tokens; only causal language modelling gives one"
            )
        for loader in (trainer.data.train, trainer.data.valid):
            if not isinstance(loader, GlobalBatchLoader):
                raise UserInputError(
                    "trainer.deterministic=true: this data source's loader cannot hand out the global "
                    "order rank-major; use data=synthetic, indexed, stdlib or hf"
                )
            loader.rank_major = True  # see [Note: global sample order] in framework/data/loader.py
        if trainer.rt.device.type == "cpu":
            torch.set_num_threads(1)
        self.trainer = trainer
        self.unit = t.deterministic_unit or t.micro_batch_size
        self.per_rank = t.global_batch_size // (trainer.dims.dp * self.unit)  # units, consecutive
        self.units = t.global_batch_size // self.unit  # units of the global batch
        trainer.model.set_deterministic_reduction(True)

    def forward_backward(self, step: int):
        """Every unit of this rank's share of step `step` (0-based) forward and backward; returns
        (the global batch's loss, on the device; the gradient norm, clipped)."""
        tr = self.trainer
        loader, device = tr.data.train, tr.rt.device
        units = []
        for _ in range(loader.accum_steps):
            units += _split(loader.next_batch(), self.unit)
        count = torch.tensor([sum(_labelled(u) for u in units)], dtype=torch.int64)
        dist.all_reduce(count)  # integers: exact in any order
        count = count.to(device).clamp(min=1)
        first = tr.job.dp_rank * self.per_rank  # this rank's first unit
        slots = torch.zeros(self.units, dtype=torch.float64, device=device)
        for j, batch in enumerate(units):
            self._seed((tr.cfg.trainer.seed * 1_000_003 + step * self.units + first + j) % 2**63)
            tr.model.set_requires_gradient_sync(j == len(units) - 1)
            loss = tr.job.task.summed_loss(tr.model, to_device(batch, device)) / count
            loss.backward()
            slots[first + j] = loss.detach().double()
        dist.all_reduce(slots)  # one non-zero per slot: exact; then the tree's order
        total = torch.tensor(tree_sum_slots(slots), dtype=torch.float64, device=device)
        limit = tr.cfg.optimizer.clip_grad_norm
        norm = canonical_grad_norm_(list(tr.model.parameters()), limit if limit > 0 else float("inf"))
        return total, norm

    def _seed(self, seed: int) -> None:
        """The unit's randomness: the default generators of the CPU and this rank's device only
        (torch.manual_seed visits every backend's, ~10 ms a call measured here)."""
        torch.default_generator.manual_seed(seed)
        if self.trainer.rt.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def train_step(self, read: bool) -> Dict[str, float]:
        """`Trainer.train_step` under the mode: the same records, the same optimizer step."""
        tr = self.trainer
        step = tr.state.step + 1
        total, grad_norm = self.forward_backward(tr.state.step)
        tr.watch.observe(step, total, grad_norm)
        out = {"lr": tr.scheduler.get_last_lr()[0]}
        if read:  # raises TrainingDiverged, before the optimizer step, if a loss was not finite
            out["loss"], out["grad_norm"] = tr.watch.read(step)
        tr.engine.optimizer_step(tr.optimizer)
        tr.scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        return out
