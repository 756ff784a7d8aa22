"""The planner for pipeline parallelism: memory per stage, the bubble, the step time with it, and
a proposal of pp where sharding alone does not fit or spends its step waiting on the network.

    stages = stage_plans(job, pp=8, schedule=PipelineSchedule.one_f_one_b, microbatches=16)
    proposal = propose_pipeline(job)        # None, or the best layout with pp and the reason

`job` is the planner's `Job` of one pipeline stage's mesh (dp_replicate x dp_shard x cp x tp: the
ranks of one stage) with the data-parallel rank's micro-batch; this module cuts its model into
stages and asks `framework.planner.estimate` for each, as the trainer builds them
(framework/distributed/pipeline.py): the first stage holds the embedding, the last the final norm
and head (the root's first tensor is the embedding, in every layout of framework/models), and each
stage's blocks are a contiguous run. Pure arithmetic, no torch.

[Note: activations held by a pipeline stage]
A stage keeps each microbatch's activations from its forward to its backward. GPipe runs every
forward first: m microbatches held. 1F1B holds at most p - r on pipeline rank r (its warm-up
forwards), so the first rank holds the most: min(m, p) microbatches of its layers. Interleaved
1F1B with v stages per rank warms up (v - 1) p + 2 (p - r - 1) + 1 chunk-forwards (Narayanan et al.
2021), each the activations of one chunk (1/v of the rank's layers); zbv as interleaved with v = 2.
The head's logits exist for the microbatch in backward only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from framework.config.pipeline import PipelineSchedule, balanced_split, bubble_fraction, even_split
from framework.models.shapes import Unit
from framework.planner.estimate import BYTES, GIB, Job, memory, timing


@dataclass(frozen=True)
class StagePlan:
    index: int  # the stage's place in the pipeline
    layers: int
    first: bool
    last: bool
    peak_bytes: int  # per rank, at the step's peak
    compute_s: float  # one step's forward and backward of this stage's layers, every microbatch
    step_s: float  # with this stage's sharding traffic, before the bubble


@dataclass(frozen=True)
class PipelinePlan:
    pp: int
    schedule: PipelineSchedule
    microbatches: int
    virtual: int
    stages: List[StagePlan]
    rank_peaks: List[int]  # per pipeline rank: its stages' peaks summed (v > 1: an upper bound)
    bubble: float  # fraction of the step every rank idles: framework/config/pipeline.py
    p2p_bytes: int  # activations and their gradients one rank sends per step
    step_s: float  # the slowest rank's stages, stretched by the bubble, plus its sends

    @property
    def peak_bytes(self) -> int:
        return max(self.rank_peaks)


def _in_flight(schedule: PipelineSchedule, pp: int, m: int, v: int, rank: int) -> float:
    """Microbatches of a rank's layers whose activations are held at its peak: [Note: activations
    held by a pipeline stage] (in units of the rank's whole layers)."""
    if schedule == PipelineSchedule.gpipe:
        return m
    if schedule == PipelineSchedule.one_f_one_b:
        return min(m, pp - rank)
    v = 2 if schedule == PipelineSchedule.zbv else v
    chunks = min(m * v, (v - 1) * pp + 2 * (pp - rank - 1) + 1)
    return chunks / v


def stage_job(job: Job, start: int, end: int, first: bool, last: bool, microbatch: int) -> Job:
    """The planner's job for one stage: blocks [start, end), the embedding if first, the norm and
    head if last, one microbatch of `microbatch` samples per forward, its units gathered as a
    stage's are ([Note: gathers of a pipeline stage] in estimate.py)."""
    whole = job.model

    def layout(shape, tp: int) -> List[Unit]:
        units = whole.layout(whole, tp)
        root, blocks = units[0], units[1:]
        kept = root.tensors[:1] if first else ()
        kept += root.tensors[1:] if last else ()
        return [Unit(root.name, kept)] + blocks[start:end]

    model = replace(whole, n_layers=end - start, layout=layout)
    return replace(job, model=model, micro_batch=microbatch, pipeline_stage=True)


def _layer_counts(job: Job, n: int, split: Optional[List[int]]) -> List[int]:
    """Blocks per stage, as the trainer cuts them: `split`, else balanced on each block's and the
    head's parameters (framework/distributed/pipeline.py)."""
    if split:
        return list(split)
    whole = job.model.layout(job.model, job.tp)
    head = sum(t.numel for t in whole[0].tensors[1:])
    counts = balanced_split([float(u.numel) for u in whole[1:]], n, float(head)) if len(whole) > n else None
    return counts or even_split(job.model.n_layers, n)


def stage_jobs(
    job: Job, pp: int, schedule: PipelineSchedule, microbatches: int, virtual: int = 1, split=None
) -> List[tuple]:
    """(pipeline rank, the stage's Job for one optimizer step: `microbatches` of the data-parallel
    rank's samples) for each of the pp x virtual stages, in order: what `stage_plans` estimates."""
    v = 2 if schedule == PipelineSchedule.zbv else virtual
    n = pp * v
    counts = _layer_counts(job, n, split)
    mb = max(1, job.micro_batch * job.accum // microbatches)
    out = []
    for s, layers in enumerate(counts):
        start = sum(counts[:s])
        sj = stage_job(job, start, start + layers, s == 0, s == n - 1, mb)
        sj = replace(sj, global_batch=mb * microbatches * job.dp)  # accum = the microbatches
        rank = s % pp if schedule != PipelineSchedule.zbv else min(s, 2 * pp - 1 - s)  # zbv: a V
        if schedule == PipelineSchedule.zbv and s > 0:  # its backward in two halves, each recomputing
            sj = replace(sj, recomputations=2)
        out.append((rank, sj))
    return out


def stage_plans(
    job: Job,
    pp: int,
    schedule: PipelineSchedule,
    microbatches: int,
    virtual: int = 1,
    split: Optional[List[int]] = None,
) -> PipelinePlan:
    """Memory and time of every stage of `job`'s model cut into pp x virtual stages."""
    v = 2 if schedule == PipelineSchedule.zbv else virtual
    jobs = stage_jobs(job, pp, schedule, microbatches, virtual, split)
    n = len(jobs)
    mb = jobs[0][1].micro_batch
    stages = []
    seen: dict = {}  # stages of equal shape plan alike (the blocks of a decoder are identical)
    for s, (rank, sj) in enumerate(jobs):
        layers = sj.model.n_layers
        key = (layers, s == 0, s == n - 1)
        if key not in seen:
            seen[key] = (memory(sj), timing(sj))
        mem, t = replace(seen[key][0]), seen[key][1]
        held = _in_flight(schedule, pp, microbatches, v, rank)
        # memory() counts one microbatch's activations of the stage's blocks; the rank holds `held`
        # microbatches of all its layers, each of its v stages its share
        mem.activations = int(mem.activations * held)
        if s != n - 1:
            mem.logits = 0
        stages.append(StagePlan(s, layers, s == 0, s == n - 1, mem.peak, t.compute_s, t.step_s))
    bubble = bubble_fraction(schedule, pp, microbatches, v)
    # Each boundary a rank sends across: one (mb, seq, dim) activation forward and its gradient
    # back per microbatch, in the compute dtype (the first and last stages one direction each).
    act = mb * job.seq_len * job.model.dim * BYTES[job.param_dtype]
    p2p = 2 * act * microbatches * v if pp > 1 else 0
    link = job.device.inter_node_gbps if job.dp * job.tp >= job.nproc_per_node else job.device.intra_node_gbps
    by_rank: dict = {}
    peaks: dict = {}
    for st, (rank, _) in zip(stages, jobs):
        by_rank[rank] = by_rank.get(rank, 0.0) + st.step_s
        peaks[rank] = peaks.get(rank, 0) + st.peak_bytes
    busiest = max(by_rank.values())
    step = busiest / (1 - bubble) + p2p / (link * 1e9 * job.device.link_efficiency)
    return PipelinePlan(pp, schedule, microbatches, v, stages, [peaks[r] for r in sorted(peaks)], bubble, p2p, step)


@dataclass(frozen=True)
class Proposal:
    pp: int
    tp: int
    dp_shard: int
    microbatches: int
    plan: PipelinePlan
    reason: str
    checkpointing: str = "none"


def _degrees_take_pp(job: Job) -> bool:
    """The mesh accepts a pipeline beside `job`'s ep and cp (framework/config/degrees.py decides)."""
    from framework.config.degrees import ParallelDims
    from framework.errors import UserInputError

    try:
        world = 2 * job.dp_shard * job.cp * job.tp
        ParallelDims(dp_replicate=1, dp_shard=job.dp_shard, tp=job.tp, ep=job.ep, cp=job.cp, pp=2, world_size=world)
    except UserInputError:
        return False
    return True


def propose_pipeline(job: Job, schedule: PipelineSchedule = PipelineSchedule.one_f_one_b) -> Optional[Proposal]:
    """A layout with pp for `job` (a pp=1 job) when sharding alone does not fit, or when its step
    waits on communication more than it computes; None when sharding alone is fine, no pp fits,
    or the job has what pipelines refuse: a model its family does not cut into stages
    (`ModelShape.pipeline`), or degrees the mesh refuses with pp (framework/config/degrees.py:
    context parallelism today); nor for tied embeddings, which pipelines run but whose stage
    memory this plan does not count (the embedding matrix on the last stage too).

    Candidates: pp in 2, 4, 8, ... dividing the world (and leaving a layer per stage), tp as
    `job`'s (tensor parallel stays inside a node), the rest sharded; microbatches of one sample
    each (the most the batch allows: the least bubble and activations). The smallest pp that
    fits wins (the least bubble and the fewest stages to balance), with `job`'s activation
    checkpointing, else with full checkpointing."""
    if not job.model.pipeline or job.model.tie_embeddings or not _degrees_take_pp(job):
        return None  # what the trainer refuses with pp, or this plan does not count
    if job.ep > 1 and not job.model.pipeline_experts:
        return None  # a family that does not split experts inside stages
    peak, t = memory(job).peak, timing(job)
    fits = peak <= job.budget_bytes
    bandwidth_bound = t.exposed_s > t.compute_s
    if fits and not bandwidth_bound:
        return None
    world = job.world
    best: Optional[Proposal] = None
    for checkpointing in dict.fromkeys([job.activation_checkpointing, "full"]):
        pp = 2
        while pp <= min(world // job.tp, job.model.n_layers) and best is None:
            if world % (pp * job.tp) == 0 and (world // (pp * job.tp)) % job.ep == 0:  # ep within dp_shard
                dp = world // (pp * job.tp)
                stage = replace(job, dp_shard=dp, dp_replicate=1, activation_checkpointing=checkpointing)
                samples = job.global_batch // dp
                m = samples  # microbatches of one sample: the least bubble and activations
                if m >= pp:
                    stage = replace(stage, micro_batch=samples // m, global_batch=samples * dp)
                    plan = stage_plans(stage, pp, schedule, m)
                    if plan.peak_bytes <= stage.budget_bytes:
                        best = Proposal(pp, job.tp, dp, m, plan, "", checkpointing)
            pp *= 2
        if best is not None:
            break
    if best is None:
        return None
    ckpt = (
        f" with activation_checkpointing={best.checkpointing}"
        if best.checkpointing != job.activation_checkpointing
        else ""
    )
    why = (
        f"sharding alone needs {peak / GIB:.1f} GiB per rank of {job.budget_bytes / GIB:.1f}"
        if not fits
        else f"sharding alone waits {t.exposed_s:.2f} s a step on its gathers and reductions over "
        f"{job.dp_shard} ranks ({t.compute_s:.2f} s of compute)"
    )
    reason = (
        f"{why}; pp={best.pp}{ckpt} shards each stage over {best.dp_shard} ranks only and sends "
        f"{best.plan.p2p_bytes / GIB:.2f} GiB of activations a step between stages: step "
        f"{best.plan.step_s:.2f} s (sharding alone {t.step_s:.2f} s) with a {best.plan.bubble:.1%} bubble "
        f"((p-1)/(m+p-1) at m={best.microbatches}), peak {best.plan.peak_bytes / GIB:.1f} GiB per rank"
    )
    return replace(best, reason=reason)


def pipeline_view(cfg, job: Job, est):
    """(estimate, notes) for `stage=plan` (framework/planner/plan.py's `make_plan`).

    parallelism.pp > 1: the estimate becomes the heaviest pipeline rank's (its stage's memory with
    the activations it holds, the step with the bubble), and a note gives every stage's peak and
    the bubble. pp = 1: the estimate stays; a note proposes a layout with pp when sharding alone
    does not fit or waits on the network longer than it computes (`propose_pipeline`)."""
    from framework.config.pipeline import virtual_stages
    from framework.planner.estimate import traffic

    p = cfg.parallelism
    schedule = PipelineSchedule(p.pp_schedule)
    if p.pp == 1:
        proposal = propose_pipeline(job, schedule if schedule != PipelineSchedule.zbv else PipelineSchedule.one_f_one_b)
        if proposal is None:
            return est, []
        return est, [
            f"proposal: parallelism.pp={proposal.pp} parallelism.tp={proposal.tp} parallelism.dp_shard="
            f"{proposal.dp_shard} parallelism.pp_microbatches={proposal.microbatches}"
            + (
                f" parallelism.activation_checkpointing={proposal.checkpointing}"
                if proposal.checkpointing != job.activation_checkpointing
                else ""
            )
            + f": {proposal.reason}"
        ]
    v = virtual_stages(schedule, p.pp_virtual_stages)
    m = job.accum if p.pp_microbatches == -1 else p.pp_microbatches
    plan = stage_plans(job, p.pp, schedule, m, v, list(p.pp_split) or None)
    heaviest = max(plan.stages, key=lambda s: s.peak_bytes)
    samples = job.micro_batch * job.accum
    sj = stage_jobs(job, p.pp, schedule, m, v, list(p.pp_split) or None)[heaviest.index][1]
    stage_est = type(est)(sj, memory(sj), traffic(sj), timing(sj))  # plan.py's Estimate, of the stage
    stage_est.memory.activations = heaviest.peak_bytes - (stage_est.memory.peak - stage_est.memory.activations)
    stage_est.memory.activations = max(0, stage_est.memory.activations)
    if not heaviest.last:
        stage_est.memory.logits = 0
    stage_est.timing = replace(
        stage_est.timing, step_s=plan.step_s, tokens_per_s=samples * job.seq_len * job.dp / plan.step_s
    )
    peaks = ", ".join(f"{s.peak_bytes / GIB:.1f}" for s in plan.stages)
    return stage_est, [
        f"pipeline: pp={p.pp} {schedule.value}, {m} microbatches, {v} stage(s) per rank: bubble {plan.bubble:.1%} "
        f"(framework/config/pipeline.py), {plan.p2p_bytes / GIB:.2f} GiB of activations sent per rank and step; "
        f"the figures above are stage {heaviest.index}'s ({heaviest.layers} layers, the heaviest, on its "
        f"{job.world} of the {job.world * p.pp} ranks) with the step's bubble; peak per stage (GiB): {peaks}"
    ]
