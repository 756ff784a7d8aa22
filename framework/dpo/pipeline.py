"""`stage=dpo` under pipeline stages (parallelism.pp > 1): the pairs laid out as the stages' rows,
the reference's log-probabilities from its own stages, the preference loss on the last stage.

[Note: preference pairs through a pipeline]
A step's pairs (this data-parallel rank's micro-batches, n pairs) become 2n rows of the stages,
which the schedule cuts into m microbatches of p = n / m pairs in order (the config checks that m
divides n): microbatch k's rows are the chosen sequences of its p pairs, then their rejected ones,
so both sequences of a pair travel in the same microbatch. Before the schedule's step every rank
of the pipeline runs the reference over the same rows, forward only, through the reference's own
stages (`build_job(reference_of=policy)` cuts it as the policy is: the same stages on the same
ranks, the same engine), or through the policy's stages with the LoRA adapters off; SimPO needs
none. Its summed log-probability of each row stays on the last stage's rank, indexed by row. The
schedule's target is each row's index ([Note: a stage's own loss through the schedule] in
framework/distributed/pipeline.py), so the last stage's loss of a microbatch finds its rows' labels
and reference numbers by index: each row's summed log-probability of its labelled tokens, the
preference loss of its p pairs (framework/dpo/loss.py), their mean; the pipeline divides it by m.
Summed over the m microbatches that is the mean over the step's n pairs, as one process's
accumulation of m micro-batches of p pairs (each mean / m) gives it, and so are the gradients.
The pairs' statistics (rewards/..., logps/...) are summed on the last stage's ranks, zeros
elsewhere, and reduced over every rank as without a pipeline.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from framework.config.dpo import PreferenceLoss
from framework.distributed.tensor_parallel import full
from framework.dpo.loss import STAT_NAMES, PairLogps, preference_loss
from framework.finetune.reference import logits_logps
from framework.models.tasks import IGNORE_INDEX, to_device
from framework.steps import RowsLoss


def by_microbatch(pairs: torch.Tensor, microbatches: int) -> torch.Tensor:
    """(n, 2, ...) pairs, chosen first -> (2n, ...) rows: for each of `microbatches` runs of n / m
    pairs in order, their chosen sequences, then their rejected ones."""
    n = pairs.shape[0]
    grouped = pairs.reshape(microbatches, n // microbatches, *pairs.shape[1:])
    return grouped.transpose(1, 2).reshape(2 * n, *pairs.shape[2:])


def row_logps(output: torch.Tensor, labels: torch.Tensor) -> tuple:
    """(summed log-probability of each row's labelled tokens, their count) from the last stage's
    output (vocabulary-sharded under tensor parallel: made whole per token)."""
    per_token = logits_logps(output, labels, full)
    mask = labels != IGNORE_INDEX
    return (per_token * mask).sum(-1), mask.sum(-1)


def stat_sums(losses: torch.Tensor, stats: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The pairs' statistics summed (named as STAT_NAMES), then the pair count."""
    sums = torch.stack([stats[n].sum() if n in stats else losses.new_zeros(()) for n in STAT_NAMES])
    return torch.cat([sums, sums.new_tensor([float(losses.numel())])])


class PipelinedPairs(RowsLoss):
    """The preference loss of [Note: preference pairs through a pipeline], for `DPOObjective`
    (framework/dpo/stage.py): its step's loss and its evaluation. `reference_runner`: the
    reference job's step runner (None: LoRA's base, the policy with its adapters off, or SimPO's
    none)."""

    def __init__(self, objective, reference_runner):
        self.objective, self.cfg = objective, objective.cfg.dpo
        self.runner, self.reference_runner = objective.job.runner, reference_runner
        self.device = objective.job.rt.device
        self.labels: Optional[torch.Tensor] = None  # the step's rows' labels
        self.reference: Optional[torch.Tensor] = None  # the reference's summed log-probability of each row

    def rows(self, batches: list, microbatches: int) -> torch.Tensor:
        ids = by_microbatch(torch.cat([b["input_ids"] for b in batches]), microbatches)
        self.labels = by_microbatch(torch.cat([b["labels"] for b in batches]), microbatches)
        if self.objective._sums is None:  # a rank without the last stage adds nothing to them
            self.objective._sums = torch.zeros(len(STAT_NAMES) + 1, device=self.device)
        self.reference = self._reference(ids)
        return ids

    def _reference(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Every row's summed log-probability under the reference, on the last stage's rank (None
        elsewhere, and for SimPO): a forward-only pass every rank of the pipeline joins."""
        if self.cfg.loss == PreferenceLoss.simpo:
            return None
        kept = {}

        def keep(output, rows):
            sums, _ = row_logps(output, self.labels[rows])
            if "sums" not in kept:
                kept["sums"] = sums.new_zeros(ids.shape[0])
            kept["sums"][rows] = sums

        if self.reference_runner is not None:
            self.reference_runner.forward_rows(ids, keep)
        else:
            from framework.peft.lora import adapters_disabled

            with adapters_disabled(self.objective.model):
                self.runner.forward_rows(ids, keep)
        return kept.get("sums")

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        sums, counts = row_logps(output, self.labels[rows])
        p = rows.shape[0] // 2  # the microbatch's pairs: chosen rows first
        policy = PairLogps(sums[:p], sums[p:], counts[:p], counts[p:])
        reference = None
        if self.reference is not None:
            reference = PairLogps(self.reference[rows[:p]], self.reference[rows[p:]], counts[:p], counts[p:])
        losses, stats = preference_loss(self.cfg, policy, reference)
        self.objective._sums += stat_sums(losses, stats).to(self.objective._sums)
        return losses.mean()

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`DPOObjective.evaluate` through the schedule's forward-only passes, a training step's
        worth of pairs each: `val_loss` and the pairs' statistics (`val_rewards/...`)."""
        objective, job = self.objective, self.objective.job
        objective.model.eval()
        valid = job.data.valid
        valid.load_state_dict({"consumed_samples": 0})
        objective._sums = None
        count = objective.cfg.trainer.eval_iters * valid.accum_steps
        batches = [to_device(valid.next_batch(), self.device) for _ in range(count)]
        total = self.runner.eval_total(batches, valid.accum_steps, self, self.device)
        dist.all_reduce(total)  # every rank of a pipeline holds its total: the world's mean is the dp ranks'
        out = {"val_loss": float(total) / dist.get_world_size() / count}
        out.update(objective._stat_means("val_"))
        objective.model.train()
        return out
