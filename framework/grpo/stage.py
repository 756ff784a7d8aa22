"""`stage=grpo`: rollouts from the policy, rewards, and the clipped-ratio objective.

One trainer step is one batch of rollouts and grpo.iterations optimizer steps on it:
1. this rank's prompts of the global batch (trainer.global_batch_size prompts over the
   data-parallel ranks, read as training reads its rows, so a resume reads the same ones);
2. grpo.num_generations completions per prompt from the policy (framework/generation on the
   sharded model; with its experts split over ep ranks, in lockstep: [Note: generation with
   experts split]), each sampled from a generator seeded by [Note: the rollout seeds];
3. their rewards ([Note: the GRPO rewards] in framework/grpo/rewards.py) and group advantages;
4. the rollout policy's log-probabilities (once, only when grpo.iterations > 1: with one iteration
   they equal the policy's own, detached) and the reference's (grpo.beta > 0);
5. grpo.iterations times: the loss of [Note: the GRPO objective] (framework/grpo/loss.py) over the
   trainer.micro_batch_size-prompt micro-batches (plus a mixture-of-experts policy's balancing
   loss, of its own forward), gradients accumulated, clipped, one optimizer step. The
   learning-rate schedule advances once per trainer step.
The reference is the one of [Note: the reference model] (framework/dpo/stage.py): LoRA's base
with its adapters off, else a frozen sharded copy of the starting model; grpo.beta=0 builds none.

[Note: the rollout seeds]
Completion k of the prompt at position i of the (shuffled) training prompts, on trainer step s,
is sampled with seed hash(trainer.seed, s, i, k): it depends neither on the rank nor on the batch
it ran in, so 1 rank and 2 ranks draw the same completions, and a resumed job redraws exactly
those of the run it continues. Tensor-parallel ranks of one group pass the same prompts and seeds.
"""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist

from framework.distributed.context_parallel import active_as
from framework.distributed.tensor_parallel import full, loss_context
from framework.errors import UserInputError
from framework.finetune.reference import copy_policy_into, disable_dropout, load_starting_weights
from framework.finetune.reference import token_logps as _token_logps
from framework.generation import generate
from framework.grpo.loss import group_advantages, grpo_loss, nan_std
from framework.grpo.rewards import Rewards
from framework.grpo.rows import rollout_seed, sequences
from framework.job import build_job
from framework.models.tasks import IGNORE_INDEX, with_aux_loss
from framework.trainer import Objective, StepWork


class GRPOObjective(Objective):
    """A step: rollouts of the step's prompts, their rewards and advantages, then grpo.iterations
    passes of the clipped-ratio loss over them (each followed by the trainer's step tail)."""

    def __init__(self, trainer):
        super().__init__(trainer)
        job = self.job
        cfg, g = job.cfg, job.cfg.grpo
        self.cfg, self.model, self.data, self.rt, self.dims, self.dp_rank = (
            cfg,
            job.model,
            job.data,
            job.rt,
            job.dims,
            job.dp_rank,
        )
        if g.disable_dropout:
            disable_dropout(self.model)
        self.train_prompts, self.valid_prompts = self.data.prompts
        # the user's module is imported here, before anything is written
        self.rewards = Rewards(g, cfg.data.hf.prompt_field)
        self._check_positions()
        self.reference, reference_runner = None, None
        if g.beta != 0 and not cfg.peft.lora.enabled:
            reference = build_job(cfg, job.rt, reference_of=job)  # weights in `start`
            self.reference, reference_runner = reference.model, reference.runner
        self.pipelined = None  # pipeline stages: [Note: GRPO through a pipeline] in framework/grpo/pipeline.py
        if not job.runner.whole_model:
            from framework.grpo.pipeline import PipelinedRollouts

            self.pipelined = PipelinedRollouts(self, reference_runner)
        self.end_of_run = None  # the rewards show how it does
        self._step = None  # the step's rollouts, rewards and statistics, for its metrics

    def _check_positions(self) -> None:
        from framework.generation.decoders import max_tokens

        limit = max_tokens(self.model)
        longest = max(len(p.ids) for p in self.train_prompts + self.valid_prompts)
        need = longest + self.cfg.grpo.max_new_tokens
        cp = self.dims.cp  # the log-probabilities' rows (need - 1 tokens) are padded to a multiple of cp
        if limit is not None and max(need, -(-(need - 1) // cp) * cp) > limit:
            split = f" (padded to a multiple of parallelism.cp={cp})" if cp > 1 else ""
            raise UserInputError(
                f"stage=grpo: a prompt of {longest} tokens + grpo.max_new_tokens={self.cfg.grpo.max_new_tokens}"
                f"{split} exceed the model's {limit} positions; lower grpo.max_new_tokens or shorten the prompts"
            )
        vocab = self.data.vocab_size
        largest = max(max(p.ids) for p in self.train_prompts + self.valid_prompts)
        if largest >= vocab:
            raise UserInputError(f"stage=grpo: a prompt has token id {largest}, past the model's {vocab} ids")

    def start(self) -> None:
        if self.reference is not None:
            load_starting_weights(self.trainer)  # before any resume (a fresh start's reads them again)
            copy_policy_into(self.model, self.reference)

    def _logps(self, model, ids, targets):
        return _token_logps(model, ids, targets, full, self.cfg.grpo.temperature)

    def _reference_logps(self, ids, targets):
        with torch.no_grad():
            if self.reference is not None:
                with active_as(self.model, self.reference):  # split as the policy's sequences are
                    return self._logps(self.reference, ids, targets)
            from framework.peft.lora import adapters_disabled

            with adapters_disabled(self.model):
                return self._logps(self.model, ids, targets)

    def _scores(self, prompts, done, group: int) -> List[float]:
        """The completions' rewards (`group` per prompt, adjacent). A reward that refuses its output on
        any rank ends every rank in one line; a reward function that raises on any rank ends every
        rank, that one with its own traceback (the user's code failing: status 1)."""
        problem, scores, failure = None, [], None
        try:
            if done:
                each = [p for p in prompts for _ in range(group)]
                scores = self.rewards(each, [c.text for c in done], [c.token_ids for c in done])
        except UserInputError as exc:
            problem = ("input", str(exc))
        except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank knows
            problem, failure = ("raised", f"{type(exc).__name__}: {exc}"), exc
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        if failure is not None:
            raise failure
        raised = next(((r, p[1]) for r, p in enumerate(problems) if p and p[0] == "raised"), None)
        if raised:
            raise RuntimeError(
                f"grpo.reward_module={self.cfg.grpo.reward_module!r} raised on rank {raised[0]}: {raised[1]} "
                "(its traceback is that rank's)"
            )
        first = next((p[1] for p in problems if p), None)
        if first:
            raise UserInputError(first)
        return scores

    def rollouts(self, step: int, indices: List[int]):
        """This rank's completions of the prompts at `indices` (grpo.num_generations each, adjacent)."""
        g, tok = self.cfg.grpo, self.data.tokenizer
        prompts = [self.train_prompts[i] for i in indices]
        seeds = [rollout_seed(self.cfg.trainer.seed, step, i, k) for i in indices for k in range(g.num_generations)]
        done = generate(
            self.model,
            [p.ids for p in prompts for _ in range(g.num_generations)],
            g.max_new_tokens,
            eos_ids=[tok.eod],
            decode=tok.decode,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            seed=seeds,
        )
        return prompts, done

    def work(self, step: int) -> StepWork:
        """The step's rollouts, rewards and advantages; grpo.iterations passes of the loss over them."""
        if self.pipelined is not None:
            return self.pipelined.work(step)
        g, model, device = self.cfg.grpo, self.model, self.rt.device
        group, loader = g.num_generations, self.data.train
        accum = loader.accum_steps
        indices = [int(i) for _ in range(accum) for i in loader.next_batch()["index"]]
        prompts, done = self.rollouts(step, indices)
        rewards = torch.tensor(self._scores(prompts, done, group), dtype=torch.float32)
        parts = []  # each reward's sum and count over the completions it scored (None: not applicable)
        for name in self.rewards.names:
            scored = [v for v in self.rewards.last.get(name, []) if not math.isnan(v)]
            parts += [sum(scored), float(len(scored))]
        spread = self._batch_std(rewards) if g.scale_rewards == "batch" else None
        advantages = group_advantages(rewards, group, g.scale_rewards, spread).to(device)
        per_micro = len(done) // accum
        micro = []  # (ids, targets, old log-probs, reference log-probs, advantages) per micro-batch
        for m in range(accum):
            part = slice(m * per_micro, (m + 1) * per_micro)
            prompt_ids = [p.ids for p in prompts for _ in range(group)][part]
            ids, targets = sequences(prompt_ids, [c.token_ids for c in done[part]], self.data.tokenizer.eod)
            ids, targets = ids.to(device), targets.to(device)
            with loss_context(model), self.job.runner.sequences_split():  # tensor / context parallel
                old = None
                if g.iterations > 1:
                    with torch.no_grad():
                        old = self._logps(model, ids, targets)
                ref = self._reference_logps(ids, targets) if g.beta != 0 else None
            micro.append((ids, targets, old, ref, advantages[part]))
        # dapo: the global batch's completion tokens per micro-batch and data-parallel rank
        tokens = torch.tensor(float(sum(len(c.token_ids) for c in done)), dtype=torch.float64, device=device)
        # tensor- and context-parallel ranks count their group's tokens too: divided by tp x cp
        dist.all_reduce(tokens)
        self._per_micro_tokens = float(tokens) / (self.dims.tp * self.dims.cp) / (accum * self.dims.dp)
        # kl and its tokens over the first iteration (the rollout policy against the reference);
        # clipped tokens and tokens over every iteration (the first clips nothing: its ratios are 1)
        stats = torch.zeros(4, device=device, dtype=torch.float64)
        self._step, self._calls = (rewards, done, stats, parts), 0
        # a mixture-of-experts policy's routers count and balance each iteration's micro-batches
        # (global-batch balancing routes them ahead, the policy's forward alone); the loss, logged
        # and observed, and the router statistics are the first iteration's (the rollout policy's)
        return StepWork(self.clipped_loss, accum, micro=micro, passes=g.iterations)

    def clipped_loss(self, batch) -> torch.Tensor:
        """[Note: the GRPO objective] on one micro-batch of rollouts; its statistics added to the step's."""
        g = self.cfg.grpo
        ids, targets, old, ref, adv = batch
        routers = self.job.runner.routers
        if routers is not None and any(r.routing_ahead for r in routers.routers):
            # the routing pass ahead of the micro-batches ([Note: global-batch load balancing]):
            # the policy's forward routes the rollouts; no statistics
            return self._logps(self.model, ids, targets).sum()
        iteration = self._calls // self.data.train.accum_steps
        self._calls += 1
        logps = self._logps(self.model, ids, targets)
        mask = targets != IGNORE_INDEX
        old = logps.detach() if old is None else old
        loss, sums = grpo_loss(
            logps,
            old,
            ref,
            adv,
            mask,
            g.epsilon,
            g.beta,
            g.kl_bias_correction,
            loss_type=g.loss_type,
            epsilon_high=g.epsilon_high,
            max_completion_length=g.max_new_tokens,
            tokens_per_micro_batch=self._per_micro_tokens,
        )
        first = float(iteration == 0)
        kl_part = [sums["kl"] * first, sums["tokens"] * first]
        self._step[2].add_(torch.stack([*kl_part, sums["clipped"], sums["tokens"]]).double())
        return with_aux_loss(self.model, loss)  # a mixture of experts' balancing, of the policy's forward

    def step_metrics(self, read: bool) -> Dict[str, float]:
        step, self._step = self._step, None
        return self._rollout_metrics(*step) if read else {}

    def _batch_std(self, rewards: torch.Tensor) -> torch.Tensor:
        """The std (Bessel's) of the global batch's rewards (grpo.scale_rewards=batch)."""
        r = rewards.double()
        r = r[~torch.isnan(r)]  # a completion with no reward is left out (as TRL's nanstd)
        sums = torch.stack([r.new_tensor(float(r.numel())), r.sum(), (r * r).sum()]).to(self.rt.device)
        dist.all_reduce(sums)  # tensor-, context-parallel and pipeline ranks hold the same rewards: tp x cp x pp times
        n, total, squares = (sums / (self.dims.tp * self.dims.cp * self.dims.pp)).tolist()
        variance = max(squares - total * total / n, 0.0) / max(n - 1.0, 1.0)
        return torch.tensor(variance**0.5, dtype=rewards.dtype)

    def _rollout_metrics(self, rewards: torch.Tensor, done, stats: torch.Tensor, parts: list) -> Dict[str, float]:
        """The global batch's reward mean (and each reward's, unweighted: `rewards/<name>`), the mean
        of its groups' reward spread, kl over the first iteration's completion tokens, the clipped
        fraction over every iteration's, and the mean completion length (tensor-parallel ranks
        count everything as often, so the ratios hold)."""
        group = self.cfg.grpo.num_generations
        grouped = rewards.view(-1, group).double()
        lengths = float(sum(len(c.token_ids) for c in done))
        scored = float((~torch.isnan(grouped)).sum())  # a completion no reward applied to is left out (TRL's nanmean)
        spread = float(nan_std(grouped, dim=1).sum())
        sums = torch.tensor(
            [float(grouped.nansum()), spread, grouped.numel(), grouped.shape[0], lengths, scored], dtype=torch.float64
        ).to(stats.device)
        sums = torch.cat([sums, stats, torch.tensor(parts, dtype=torch.float64, device=stats.device)])
        dist.all_reduce(sums)
        reward, spread, count, groups, length, scored, kl, kl_tokens, clipped, tokens = sums.tolist()[:10]
        out = {"reward": reward / max(scored, 1.0), "reward_std": spread / groups, "completion_length": length / count}
        each = sums.tolist()[10:]
        for name, total, counted in zip(self.rewards.names, each[0::2], each[1::2]):
            out[f"rewards/{name}"] = total / max(counted, 1.0)
        if self.cfg.grpo.beta != 0:
            out["kl"] = kl / max(kl_tokens, 1.0)
        out["clip_fraction"] = clipped / max(tokens, 1.0)
        return out

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`val_reward`: the mean reward of one greedy completion of each validation prompt (each
        data-parallel rank takes every dp-th prompt)."""
        if self.pipelined is not None:
            return self.pipelined.evaluate()
        g, tok = self.cfg.grpo, self.data.tokenizer
        mine = self.valid_prompts[self.dp_rank :: self.dims.dp]
        # every rank calls, a rank with no prompt too: under FSDP2 and expert parallelism the
        # forwards are collective and it runs the others' steps ([Note: generation with experts split])
        done = generate(self.model, [p.ids for p in mine], g.max_new_tokens, eos_ids=[tok.eod], decode=tok.decode)
        scores = self._scores(mine, done, 1)
        scores = [v for v in scores if not math.isnan(v)]  # no reward applied: left out (TRL's nanmean)
        sums = torch.tensor([sum(scores), float(len(scores))], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(sums)
        return {"val_reward": float(sums[0] / sums[1].clamp(min=1))}
