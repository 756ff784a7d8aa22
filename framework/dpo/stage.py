"""`stage=dpo`: a preference loss on the trainer's loop, and the reference model it needs.

[Note: the reference model]
DPO and IPO compare the policy's log-probabilities with those of the model it started from. That
reference is either
- with LoRA (peft.lora.enabled=true): the policy itself with its adapters switched off
  (framework/peft/lora.py `adapters_disabled`): the frozen base is the starting model, no second copy;
- otherwise: a second copy built by `build_job(cfg, rt, reference_of=policy)` (framework/job.py):
  the same family, tensor-parallel plan and engine over the same mesh, every parameter frozen, in
  eval mode, given the policy's starting weights shard by shard (the two layouts are the same,
  so each rank copies its own pieces). The starting weights are the seeded initialisation, the
  import (checkpoint.init_from, model.path) or the checkpoint of another stage the run started
  from ([Note: a checkpoint of another stage] in framework/checkpoint/manager.py: a resume of this stage finds it in its
  checkpoint's train_state.json), read before any resume (a fresh start's resume reads them once
  more), so the reference is the starting model, not the resumed policy. A checkpoint holds the
  policy only.
SimPO needs no reference; none is built.

The reference runs under torch.no_grad() before the policy's forward of the same micro-batch, so
only the policy's graph is kept for backward. Under context parallelism it takes the same chunks
of the sequences as the policy (`active_as`: its exchange is on while the policy's is); under
expert parallelism its experts are split as the policy's; a mixture of experts' balancing loss
is the policy's forward's alone (the reference's is computed without gradients and dropped).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict

import torch
import torch.distributed as dist

from framework.config.dpo import PreferenceLoss
from framework.distributed.context_parallel import active_as
from framework.distributed.tensor_parallel import full, loss_context
from framework.dpo.loss import STAT_NAMES, pair_logps, preference_loss
from framework.finetune.reference import copy_policy_into, disable_dropout, load_starting_weights
from framework.job import build_job
from framework.models.tasks import to_device, with_aux_loss
from framework.trainer import Objective


def _chosen_only(data):
    """The data bundle with each pair row as its chosen sequence alone (a fine-tuning row)."""
    from framework.data.loader import GlobalBatchLoader
    from framework.finetune.data import RowSource

    def chosen(loader):
        rows = [{key: value[0] for key, value in row.items()} for row in loader.source.rows]
        return GlobalBatchLoader(
            RowSource(rows),
            micro_batch_size=loader.micro,
            global_batch_size=loader.global_batch,
            dp_rank=loader.dp_rank,
            dp_size=loader.dp_size,
        )

    return dataclasses.replace(data, train=chosen(data.train), valid=chosen(data.valid))


def _on_chosen(end_of_run, run):
    """The task's end-of-run showing (a text sample) on the chosen sequences of the data."""
    return end_of_run(dataclasses.replace(run, data=_chosen_only(run.data)))


class DPOObjective(Objective):
    """The micro-batch's mean preference loss; the step's and the validation's per-pair statistics."""

    def __init__(self, trainer):
        super().__init__(trainer)
        cfg, job = self.job.cfg, self.job
        self.cfg, self.model = cfg, job.model
        if cfg.dpo.disable_dropout:
            disable_dropout(self.model)
        self.reference, reference_runner = None, None
        if cfg.dpo.loss != PreferenceLoss.simpo and not cfg.peft.lora.enabled:
            reference = build_job(cfg, job.rt, reference_of=job)  # weights in `start`
            self.reference, reference_runner = reference.model, reference.runner
        self.pipelined = None  # pipeline stages: [Note: preference pairs through a pipeline]
        if not job.runner.whole_model:
            from framework.dpo.pipeline import PipelinedPairs

            self.pipelined = PipelinedPairs(self, reference_runner)
        self._sums = None  # the step's per-pair statistics summed, then the pair count
        if self.end_of_run is not None:  # the end-of-run sample reads the chosen sequences
            self.end_of_run = functools.partial(_on_chosen, self.end_of_run)

    def start(self) -> None:
        if self.reference is not None:
            load_starting_weights(self.trainer)  # before any resume (a fresh start's reads them again)
            copy_policy_into(self.model, self.reference)

    def _reference_logps(self, ids, labels):
        if self.cfg.dpo.loss == PreferenceLoss.simpo:
            return None
        with torch.no_grad():
            if self.reference is not None:
                with active_as(self.model, self.reference):  # split as the policy's sequences are
                    return pair_logps(self.reference, ids, labels, full)
            from framework.peft.lora import adapters_disabled

            with adapters_disabled(self.model):
                return pair_logps(self.model, ids, labels, full)

    def preference_loss(self, batch) -> torch.Tensor:
        """The micro-batch's mean preference loss; its per-pair statistics are added to the step's."""
        ids, labels = batch["input_ids"], batch["labels"]
        routers = getattr(self.job.runner, "routers", None)  # a pipeline's runner keeps none
        if routers is not None and any(r.routing_ahead for r in routers.routers):
            # the routing pass ahead of the step ([Note: global-batch load balancing]): the
            # policy's forward routes the pairs; no reference, no statistics
            return pair_logps(self.model, ids, labels, full).chosen.sum()
        reference = self._reference_logps(ids, labels)
        losses, stats = preference_loss(self.cfg.dpo, pair_logps(self.model, ids, labels, full), reference)
        sums = torch.stack([stats[n].sum() if n in stats else losses.new_zeros(()) for n in STAT_NAMES])
        sums = torch.cat([sums, sums.new_tensor([float(losses.numel())])])
        self._sums = sums if self._sums is None else self._sums + sums
        return with_aux_loss(self.model, losses.mean())  # a mixture of experts' balancing, of the policy's forward

    def work(self, step):
        self._sums = None
        loss = self.preference_loss if self.pipelined is None else self.pipelined
        return dataclasses.replace(super().work(step), loss=loss)

    def step_metrics(self, read: bool) -> Dict[str, float]:
        out = self._stat_means() if read else {}
        self._sums = None
        return out

    def _stat_means(self, prefix: str = "") -> Dict[str, float]:
        """The pairs' mean of each statistic over every rank (tensor-parallel ranks count their
        pairs as often as their numbers, so the mean is the same)."""
        sums, self._sums = self._sums, None
        dist.all_reduce(sums)
        count = float(sums[-1])
        names = STAT_NAMES if self.cfg.dpo.loss != PreferenceLoss.simpo else STAT_NAMES[:6]
        return {f"{prefix}{n}": float(sums[STAT_NAMES.index(n)]) / count for n in names}

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`val_loss` and the statistics (`val_rewards/...`) over the first trainer.eval_iters
        global batches of the validation pairs."""
        if self.pipelined is not None:
            return self.pipelined.evaluate()
        self.model.eval()
        valid, device = self.job.data.valid, self.job.rt.device
        valid.load_state_dict({"consumed_samples": 0})
        self._sums = None
        total, count = torch.zeros((), device=device), self.cfg.trainer.eval_iters * valid.accum_steps
        for _ in range(count):
            with loss_context(self.model), self.job.runner.sequences_split():
                total += full(self.preference_loss(to_device(valid.next_batch(), device)))
        dist.all_reduce(total)
        out = {"val_loss": float(total) / dist.get_world_size() / count}
        out.update(self._stat_means("val_"))
        self.model.train()
        return out
