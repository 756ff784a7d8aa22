"""Pipeline parallelism's settings and their arithmetic (`parallelism.pp*`), importable without torch.

    pp                   stages across ranks (the outermost mesh dimension: pp x dp_replicate x
                         dp_shard x cp x tp)
    pp_schedule          gpipe | 1f1b | interleaved_1f1b | zbv (torch.distributed.pipelining's
                         ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    pp_microbatches      microbatches per optimizer step per data-parallel rank; -1: the gradient
                         accumulation steps (global batch / (micro batch x dp))
    pp_virtual_stages    stages per rank; -1: 1 for gpipe/1f1b, 2 for interleaved_1f1b and zbv
    pp_split             layers per stage, in stage order (pp x virtual stages entries summing to
                         the model's layers); empty: balanced by work (`balanced_split`)

The planner (framework/planner) and the config validation read the bubble fraction and the
resolved numbers from here; the trainer builds the schedule from them
(framework/distributed/pipeline.py).
"""

from __future__ import annotations

from enum import Enum
from typing import List


class PipelineSchedule(str, Enum):
    gpipe = "gpipe"  # every forward, then every backward
    one_f_one_b = "1f1b"  # one forward, one backward in the steady state
    interleaved_1f1b = "interleaved_1f1b"  # 1F1B over several stages per rank (looped)
    zbv = "zbv"  # zero bubble, V-shaped placement of two stages per rank

    def __str__(self) -> str:  # the config field is a str (Hydra matches enums by name): round-trips
        return self.value


_MULTI_STAGE = (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zbv)


def virtual_stages(schedule: PipelineSchedule, requested: int) -> int:
    """Stages per rank: `requested`, or the schedule's own default (-1)."""
    if requested != -1:
        return requested
    return 2 if schedule in _MULTI_STAGE else 1


def pipeline_problems(p) -> List[str]:
    """The `parallelism` section's pipeline fields checked on their own (one line each)."""
    errors: List[str] = []
    if p.pp < 1:
        errors.append(f"parallelism.pp={p.pp}: must be a positive degree (1: no pipeline)")
    if p.pp_microbatches == 0 or p.pp_microbatches < -1:
        errors.append(
            f"parallelism.pp_microbatches={p.pp_microbatches}: must be positive, or -1 (the gradient "
            "accumulation steps)"
        )
    v = p.pp_virtual_stages
    if v == 0 or v < -1:
        errors.append(f"parallelism.pp_virtual_stages={v}: must be positive, or -1 (the schedule's own)")
    elif p.pp_schedule == PipelineSchedule.zbv and v not in (-1, 2):
        errors.append(
            f"parallelism.pp_virtual_stages={v} with parallelism.pp_schedule=zbv: zbv runs exactly 2 stages per rank"
        )
    elif p.pp_schedule == PipelineSchedule.interleaved_1f1b and v == 1:
        errors.append(
            "parallelism.pp_virtual_stages=1 with parallelism.pp_schedule=interleaved_1f1b: interleaving needs "
            "at least 2 stages per rank; choose pp_schedule=1f1b or pp_virtual_stages >= 2"
        )
    elif p.pp_schedule not in _MULTI_STAGE and v not in (-1, 1):
        errors.append(
            f"parallelism.pp_virtual_stages={v} with parallelism.pp_schedule={p.pp_schedule.value}: one stage per "
            "rank; choose pp_schedule=interleaved_1f1b or zbv for more"
        )
    if any(n < 1 for n in p.pp_split):
        errors.append(f"parallelism.pp_split={list(p.pp_split)}: every stage needs at least one layer")
    if p.pp > 1 and p.pp_split and not errors:
        stages = p.pp * virtual_stages(p.pp_schedule, v)
        if len(p.pp_split) != stages:
            errors.append(
                f"parallelism.pp_split has {len(p.pp_split)} entries for {stages} stages (pp={p.pp} x "
                f"{virtual_stages(p.pp_schedule, v)} per rank); give one layer count per stage"
            )
    return errors


def job_problems(cfg) -> List[str]:
    """What a pipeline job cannot do beside training, one line each. Validation runs the schedule
    forward only (`schedule.eval`), which torch's ZBV schedule cannot do (its V passes a backward
    between a rank's two stages even then)."""
    p, t = cfg.parallelism, cfg.trainer
    if p.pp == 1:
        return []
    errors = []
    if p.pp_schedule == PipelineSchedule.zbv and t.eval_interval:
        errors.append(
            f"parallelism.pp_schedule=zbv with trainer.eval_interval={t.eval_interval}: torch's ZBV schedule has "
            "no forward-only pass for validation; set trainer.eval_interval=0 or pp_schedule=interleaved_1f1b"
        )
    return errors


def microbatch_problems(p, samples_per_rank: int, accum_steps: int) -> List[str]:
    """pp_microbatches against one data-parallel rank's samples per step and the schedule's needs."""
    if p.pp == 1:
        return []
    m = accum_steps if p.pp_microbatches == -1 else p.pp_microbatches
    errors = []
    if samples_per_rank % m:
        errors.append(
            f"parallelism.pp_microbatches={m} does not divide the {samples_per_rank} samples each data-parallel "
            "rank trains on per step (trainer.global_batch_size / dp); choose a divisor"
        )
    if p.pp_schedule != PipelineSchedule.gpipe and m < p.pp:
        errors.append(
            f"parallelism.pp_microbatches={m} with parallelism.pp={p.pp} and pp_schedule={p.pp_schedule.value}: "
            "the schedule needs at least one microbatch per stage rank; raise pp_microbatches (or the "
            "accumulation steps) to >= pp"
        )
    if p.pp_schedule in _MULTI_STAGE and m % p.pp:
        errors.append(
            f"parallelism.pp_microbatches={m} with parallelism.pp_schedule={p.pp_schedule.value}: must be a "
            f"multiple of parallelism.pp={p.pp}"
        )
    return errors


def even_split(n_layers: int, stages: int) -> List[int]:
    """Layers per stage, as even as possible (the earlier stages take one more)."""
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def balanced_split(block_costs: List[float], stages: int, head_cost: float = 0.0) -> List[int]:
    """Layers per stage for `stages` contiguous stages of blocks costing `block_costs` each, the
    last stage also running the head (`head_cost`; the embedding, a lookup, costs nothing): the
    least cost of the busiest stage, every stage at least one block. The even split when it is
    as good (it is the usual answer: a head narrower than a block changes nothing)."""
    n = len(block_costs)
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(a: int, b: int, last: bool) -> float:
        return prefix[b] - prefix[a] + (head_cost if last else 0.0)

    def busiest(counts: List[int]) -> float:
        starts = [sum(counts[:s]) for s in range(len(counts))]
        return max(cost(a, a + c, s == len(counts) - 1) for s, (a, c) in enumerate(zip(starts, counts)))

    even = even_split(n, stages)
    # best[s][i]: the least busiest cost of blocks [0, i) in s stages (not the last), and its cut
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    best[0] = [inf] + [cost(0, i, stages == 1 and i == n) for i in range(1, n + 1)]
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            for j in range(s, i):
                value = max(best[s - 1][j], cost(j, i, s == stages - 1 and i == n))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    counts.append(i)
    counts.reverse()
    return even if busiest(even) <= busiest(counts) + 1e-9 * prefix[-1] else counts


def bubble_fraction(schedule: PipelineSchedule, pp: int, microbatches: int, virtual: int = 1) -> float:
    """The fraction of a step each rank idles, for equal stage times (forward F, backward 2F).

    gpipe and 1f1b: (p - 1) / (m + p - 1) (both fill and drain the pipeline once).
    interleaved_1f1b with v stages per rank: (p - 1) / (v m + p - 1) (Narayanan et al. 2021: the
    fill and drain shrink v-fold).
    zbv: torch's ZB-V order (ScheduleZBVZeroBubble, two stages per rank) with each stage's
    forward, input-gradient and weight-gradient halves equal (its backward 2F, split in two;
    framework/distributed/pipeline.py, [Note: zero-bubble schedules on our engine]): a rank is busy
    6m such units a step and idles max(p - 1, 2 (2p - 1 - m)) of them: p - 1 once
    m >= (3p - 1) / 2 (the weight halves fill the rest; Qi et al. 2024, section 6), more below,
    where the order has too few microbatches to fill its V. Read off that order's timeline
    (tests/planner/test_pipeline_plan.py simulates it).
    """
    if pp <= 1:
        return 0.0
    if schedule in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == PipelineSchedule.zbv:
        idle = max(pp - 1, 2 * (2 * pp - 1 - microbatches))
        return idle / (6 * microbatches + idle)
    return (pp - 1) / (virtual * microbatches + pp - 1)
