"""`stage=dpo`: the trainer's loop with a preference loss, and the reference model it needs.

[Note: the reference model]
DPO and IPO compare the policy's log-probabilities with those of the model it started from. That
reference is either
- with LoRA (peft.lora.enabled=true): the policy itself with its adapters switched off
  (framework/peft/lora.py `adapters_disabled`): the frozen base is the starting model, no second copy;
- otherwise: a second copy built and sharded exactly as the policy (the same family, tensor-parallel
  plan and engine over the same mesh), every parameter frozen, in eval mode, given the policy's
  starting weights shard by shard (the two layouts are the same, so each rank copies its own
  pieces). The starting weights are the seeded initialisation, the import (checkpoint.init_from,
  model.path) or the checkpoint of another stage the run started from ([Note: a checkpoint of
  another stage] in framework/checkpoint/manager.py: a resume of this stage finds it in its
  checkpoint's train_state.json), read before any resume (a fresh start's resume reads them once
  more), so the reference is the starting model, not the resumed policy. A checkpoint holds the
  policy only.
SimPO needs no reference; none is built.

The reference runs under torch.no_grad() before the policy's forward of the same micro-batch, so
only the policy's graph is kept for backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict

import torch
import torch.distributed as dist

from framework.config.dpo import PreferenceLoss
from framework.distributed.tensor_parallel import full, loss_context
from framework.dpo.data import build_dpo_data
from framework.dpo.loss import STAT_NAMES, pair_logps, preference_loss
from framework.finetune.reference import build_reference, copy_policy_into, disable_dropout, load_starting_weights
from framework.models.tasks import to_device
from framework.trainer import Trainer


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


class DPOTrainer(Trainer):
    data_builder = staticmethod(build_dpo_data)  # preference pairs through data=hf

    def __init__(self, cfg, rt):
        super().__init__(cfg, rt)
        d = cfg.dpo
        if d.disable_dropout:
            disable_dropout(self.model)
        self.reference = None
        if d.loss != PreferenceLoss.simpo and not cfg.peft.lora.enabled:
            self.reference = build_reference(self)  # weights in `fit`
        self._sums = None  # the step's per-pair statistics summed, then the pair count
        if self.task.end_of_run is not None:  # the end-of-run sample reads the chosen sequences
            self.task = dataclasses.replace(self.task, end_of_run=functools.partial(_on_chosen, self.task.end_of_run))

    def fit(self, started=None) -> int:
        if self.reference is not None:
            load_starting_weights(self)  # before any resume (a fresh start's reads them again)
            copy_policy_into(self.model, self.reference)
        return super().fit(started)

    def _reference_logps(self, ids, labels):
        if self.cfg.dpo.loss == PreferenceLoss.simpo:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return pair_logps(self.reference, ids, labels, full)
            from framework.peft.lora import adapters_disabled

            with adapters_disabled(self.model):
                return pair_logps(self.model, ids, labels, full)

    def _loss(self, batch) -> torch.Tensor:
        """The micro-batch's mean preference loss; its per-pair statistics are added to the step's."""
        ids, labels = batch["input_ids"], batch["labels"]
        reference = self._reference_logps(ids, labels)
        losses, stats = preference_loss(self.cfg.dpo, pair_logps(self.model, ids, labels, full), reference)
        sums = torch.stack([stats[n].sum() if n in stats else losses.new_zeros(()) for n in STAT_NAMES])
        sums = torch.cat([sums, sums.new_tensor([float(losses.numel())])])
        self._sums = sums if self._sums is None else self._sums + sums
        return losses.mean()

    def _stat_means(self, prefix: str = "") -> Dict[str, float]:
        """The pairs' mean of each statistic over every rank (tensor-parallel ranks count their
        pairs as often as their numbers, so the mean is the same)."""
        sums, self._sums = self._sums, None
        dist.all_reduce(sums)
        count = float(sums[-1])
        names = STAT_NAMES if self.cfg.dpo.loss != PreferenceLoss.simpo else STAT_NAMES[:6]
        return {f"{prefix}{n}": float(sums[STAT_NAMES.index(n)]) / count for n in names}

    def train_step(self, read: bool = True) -> Dict[str, float]:
        self._sums = None
        out = super().train_step(read)
        if read:
            out.update(self._stat_means())
        self._sums = None
        return out

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`val_loss` and the statistics (`val_rewards/...`) over the first trainer.eval_iters
        global batches of the validation pairs."""
        self.model.eval()
        valid = self.data.valid
        valid.load_state_dict({"consumed_samples": 0})
        self._sums = None
        total, count = torch.zeros((), device=self.rt.device), self.cfg.trainer.eval_iters * valid.accum_steps
        for _ in range(count):
            with loss_context(self.model):
                total += full(self._loss(to_device(valid.next_batch(), self.rt.device)))
        dist.all_reduce(total)
        out = {"val_loss": float(total) / dist.get_world_size() / count}
        out.update(self._stat_means("val_"))
        self.model.train()
        return out

    def _sequences_split(self):
        return contextlib.nullcontext()  # context parallelism is refused for stage=dpo
