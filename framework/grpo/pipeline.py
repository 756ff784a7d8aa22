"""`stage=grpo` under pipeline stages (parallelism.pp > 1): the rollouts generated through every
stage in turn, the log-probabilities of the completions through the stages, the clipped-ratio loss
on the last stage.

[Note: GRPO through a pipeline]
No rank holds the whole policy, so the rollouts are decoded through the pipeline's stage-by-stage
walk (`ScheduleSteps.logits`: each stage on its rank in turn, outside the schedule, the hidden
states sent to the next stage's rank, the last stage's logits broadcast over the pipeline). Every
rank of a pipeline generates the same completions of its data-parallel rank's prompts: each
completion draws from its own generator seeded by [Note: the rollout seeds] (framework/grpo/stage.py)
with `next_token`, as `generate` does without a pipeline, so the completions are one process's (up
to the float rounding of logits computed without a cache, which does not change a token on our
models: the tests compare the rewards exactly). Prompts of the same length decode together (no
padding, so no positions or masks to pass the stages); there is no KV cache: each new token runs
the whole sequence through every stage again, so a completion of n tokens costs about n / 2 times
the forward passes of one cached decoding (its prompt and everything before it recomputed each
time), plus two point-to-point sends and a broadcast of the logits per stage boundary and token.
The stages' forwards gather their shards over the data-parallel ranks, so every rank of the world
runs as many forwards as the busiest (a spare one-token row where it has none left; one all-reduce
per token agrees on it).

Each completion is then one row of the stages: its prompt and completion, padded at the end to
data.seq_len (the schedule's static shape; padding after a row changes none of its earlier
positions, and its targets are ignored), in the order of one process's micro-batches, so the
schedule's microbatch k is micro-batch k when parallelism.pp_microbatches is the accumulation (its
default). Before the first pass, forward-only passes through the stages (`forward_rows`) give the
last stage's rank the rollout policy's per-token log-probabilities (grpo.iterations > 1) and the
reference's (grpo.beta > 0: the reference job's own stages, or the policy's with LoRA's adapters
off), indexed by row. Each of grpo.iterations passes is one schedule step whose microbatch loss is
[Note: the GRPO objective] (framework/grpo/loss.py) of the microbatch's rows, divided by the
pipeline's microbatches as one process's micro-batch losses are divided by their number; dapo's
divisor is the global batch's completion tokens over (microbatches x data-parallel ranks), so the
step is one process's for every loss type; bnpo's is a microbatch's own tokens, as it is a
micro-batch's without a pipeline (it depends on parallelism.pp_microbatches as on
trainer.micro_batch_size). The statistics (kl, clipped tokens) are summed on the last stage's rank,
zeros elsewhere; the rewards are counted by every rank of the pipeline, and each metric is a ratio
of sums over the world, so the counts cancel.
"""

from __future__ import annotations

import math
from itertools import groupby
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from framework.distributed.tensor_parallel import full
from framework.errors import UserInputError
from framework.finetune.reference import logits_logps
from framework.generation import Completion
from framework.grpo.loss import group_advantages, grpo_loss
from framework.models.tasks import IGNORE_INDEX, next_token
from framework.steps import RowsLoss


def _busiest(flag: int) -> int:
    """The largest `flag` over every rank (each stage's forward gathers over the data-parallel ranks)."""
    t = torch.tensor([flag], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # gloo: a CPU tensor
    return int(t.item())


@torch.no_grad()
def generate_through_stages(
    runner,
    prompts: List[List[int]],
    max_new_tokens: int,
    *,
    eos_id: int,
    decode,
    device,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seeds: Optional[List[int]] = None,
) -> List[Completion]:
    """The completions of `prompts` decoded through the pipeline's stages ([Note: GRPO through a
    pipeline]); every rank of the world calls it together (its own prompts, any number)."""
    seeds = seeds if seeds is not None else [0] * len(prompts)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    outs: List[List[int]] = [[] for _ in prompts]
    reasons: List[Optional[str]] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    groups = [list(g) for _, g in groupby(order, key=lambda i: len(prompts[i]))]
    was_training = runner.model.training
    runner.model.eval()
    try:
        for n in range(_busiest(len(groups))):
            rows = groups[n] if n < len(groups) else []
            ids = torch.tensor([prompts[i] for i in rows] or [[eos_id]], device=device)
            for step in range(max_new_tokens):
                logits = runner.logits(ids)[:, -1].cpu()
                following = []
                for j, i in enumerate(rows):
                    if reasons[i] is None:
                        token = next_token(logits[j], temperature, top_k, top_p, gens[i])
                        outs[i].append(token)
                        if token == eos_id:
                            reasons[i] = "eos"
                        elif len(outs[i]) >= max_new_tokens:
                            reasons[i] = "length"
                    following.append(outs[i][-1] if reasons[i] is None else eos_id)
                busy = any(reasons[i] is None for i in rows)
                if step == max_new_tokens - 1 or not _busiest(int(busy)):
                    break
                following = following or [eos_id]  # the spare row
                ids = torch.cat([ids, torch.tensor(following, device=device)[:, None]], dim=1)
    finally:
        runner.model.train(was_training)
    texts = [decode(o[:-1] if r == "eos" else o) for o, r in zip(outs, reasons)]
    return [Completion(o, t, r or "length") for o, t, r in zip(outs, texts, reasons)]


class PipelinedRollouts(RowsLoss):
    """[Note: GRPO through a pipeline] for `GRPOObjective` (framework/grpo/stage.py): its step's
    rollouts and loss, and its evaluation. `reference_runner`: the reference job's step runner
    (None: LoRA's base, the policy with its adapters off, or no reference at grpo.beta=0)."""

    def __init__(self, objective, reference_runner):
        self.objective, self.cfg = objective, objective.cfg
        self.runner, self.reference_runner = objective.job.runner, reference_runner
        self.device = objective.rt.device
        self.seq_len = objective.cfg.data.seq_len
        self.passes = 0  # schedule steps over this step's rollouts so far
        self.targets = self.advantages = self.old = self.reference = None
        self.per_micro_tokens = 0.0
        prompts = objective.train_prompts + objective.valid_prompts
        longest = max(len(p.ids) for p in prompts)
        need = longest + self.cfg.grpo.max_new_tokens - 1
        if need > self.seq_len:
            raise UserInputError(
                f"stage=grpo with parallelism.pp={objective.dims.pp}: a prompt of {longest} tokens + "
                f"grpo.max_new_tokens={self.cfg.grpo.max_new_tokens} make rows of {need} tokens, longer than the "
                f"pipeline's data.seq_len={self.seq_len} (its stages' fixed shape); raise data.seq_len to {need} or "
                "lower grpo.max_new_tokens"
            )

    def _generate(self, prompts, **sampling) -> List[Completion]:
        tok, g = self.objective.data.tokenizer, self.cfg.grpo
        return generate_through_stages(
            self.runner, prompts, g.max_new_tokens, eos_id=tok.eod, decode=tok.decode, device=self.device, **sampling
        )

    def _rows(self, prompts: List[List[int]], completions: List[List[int]]):
        """(ids, targets) of each prompt and its completion, padded at the end to data.seq_len."""
        from framework.grpo.rows import sequences

        ids, targets = sequences(prompts, completions, self.objective.data.tokenizer.eod)
        width = self.seq_len - ids.shape[1]
        ids = torch.nn.functional.pad(ids, (0, width), value=self.objective.data.tokenizer.eod)
        targets = torch.nn.functional.pad(targets, (0, width), value=IGNORE_INDEX)
        return ids.to(self.device), targets.to(self.device)

    def _token_logps(self, runner, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Every row's per-token log-probabilities of its targets under `runner`'s stages, on the
        last stage's rank (None elsewhere): a forward-only pass every rank of the pipeline joins."""
        kept = {}

        def keep(output, rows):
            logps = logits_logps(output, self.targets[rows], full, self.cfg.grpo.temperature)
            if "logps" not in kept:
                kept["logps"] = logps.new_zeros(self.targets.shape)
            kept["logps"][rows] = logps

        runner.forward_rows(ids, keep)
        return kept.get("logps")

    def _reference_logps(self, ids: torch.Tensor) -> Optional[torch.Tensor]:
        if self.reference_runner is not None:
            return self._token_logps(self.reference_runner, ids)
        from framework.peft.lora import adapters_disabled

        with adapters_disabled(self.objective.model):
            return self._token_logps(self.runner, ids)

    def work(self, step: int):
        """`GRPOObjective.work` through the stages: the rollouts, their rewards and advantages, the
        rollout policy's and the reference's log-probabilities, grpo.iterations schedule steps."""
        from framework.grpo.rows import rollout_seed
        from framework.trainer import StepWork

        o, g = self.objective, self.cfg.grpo
        group, loader = g.num_generations, o.data.train
        accum = loader.accum_steps
        indices = [int(i) for _ in range(accum) for i in loader.next_batch()["index"]]
        prompts = [o.train_prompts[i] for i in indices]
        seeds = [rollout_seed(self.cfg.trainer.seed, step, i, k) for i in indices for k in range(group)]
        each = [p.ids for p in prompts for _ in range(group)]
        sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seeds=seeds)
        done = self._generate(each, **sampling)
        rewards = torch.tensor(o._scores(prompts, done, group), dtype=torch.float32)
        parts = []  # each reward's sum and count over the completions it scored
        for name in o.rewards.names:
            scored = [v for v in o.rewards.last.get(name, []) if not math.isnan(v)]
            parts += [sum(scored), float(len(scored))]
        spread = o._batch_std(rewards) if g.scale_rewards == "batch" else None
        self.advantages = group_advantages(rewards, group, g.scale_rewards, spread).to(self.device)
        ids, self.targets = self._rows(each, [c.token_ids for c in done])
        self.old = self._token_logps(self.runner, ids) if g.iterations > 1 else None
        self.reference = self._reference_logps(ids) if g.beta != 0 else None
        # dapo: the global batch's completion tokens over (microbatches x data-parallel ranks); every
        # rank of a pipeline, tensor- and context-parallel group counts its data-parallel rank's
        tokens = torch.tensor(float(sum(len(c.token_ids) for c in done)), dtype=torch.float64, device=self.device)
        dist.all_reduce(tokens)
        d = o.dims
        self.per_micro_tokens = float(tokens) / (d.tp * d.cp * d.pp) / (self.runner.schedule.microbatches * d.dp)
        stats = torch.zeros(4, device=self.device, dtype=torch.float64)
        o._step, self.passes = (rewards, done, stats, parts), 0
        per_micro = ids.shape[0] // accum
        micro = [ids[m * per_micro : (m + 1) * per_micro] for m in range(accum)]  # one process's micro-batches
        return StepWork(self, accum, micro=micro, passes=g.iterations, routed=False)

    def rows(self, batches: list, microbatches: int) -> torch.Tensor:
        self.passes += 1
        return torch.cat(batches)

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        g = self.cfg.grpo
        targets = self.targets[rows]
        logps = logits_logps(output, targets, full, g.temperature)
        old = logps.detach() if self.old is None else self.old[rows]
        ref = None if self.reference is None else self.reference[rows]
        loss, sums = grpo_loss(
            logps,
            old,
            ref,
            self.advantages[rows],
            targets != IGNORE_INDEX,
            g.epsilon,
            g.beta,
            g.kl_bias_correction,
            loss_type=g.loss_type,
            epsilon_high=g.epsilon_high,
            max_completion_length=g.max_new_tokens,
            tokens_per_micro_batch=self.per_micro_tokens,
        )
        first = float(self.passes == 1)  # kl over the first pass (the rollout policy's own)
        stats = self.objective._step[2]
        stats.add_(torch.stack([sums["kl"] * first, sums["tokens"] * first, sums["clipped"], sums["tokens"]]).double())
        return loss

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`GRPOObjective.evaluate` through the stages: one greedy completion of each validation
        prompt (each data-parallel rank every dp-th one), `val_reward` their mean reward."""
        o = self.objective
        mine = o.valid_prompts[o.dp_rank :: o.dims.dp]
        done = self._generate([p.ids for p in mine])
        scores = [v for v in o._scores(mine, done, 1) if not math.isnan(v)]
        sums = torch.tensor([sum(scores), float(len(scores))], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)  # every rank of a pipeline counts its prompts: the ratio holds
        return {"val_reward": float(sums[0] / sums[1].clamp(min=1))}
