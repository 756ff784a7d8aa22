"""The planner's pipeline figures: the bubble against its formula, memory per stage against the
whole model's, and the proposal of pp for Llama 3.1 405B on 64 nodes x 8 GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from framework.config import compose_config, to_config
from framework.config.pipeline import PipelineSchedule, balanced_split, bubble_fraction, virtual_stages
from framework.planner.estimate import memory
from framework.planner.pipeline import propose_pipeline, stage_job, stage_jobs, stage_plans
from framework.planner.plan import job_from_config

ONE_F_ONE_B = PipelineSchedule.one_f_one_b


def _job(*overrides):
    return job_from_config(to_config(compose_config(["stage=plan", *overrides])))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 64), (16, 16)])
def test_bubble_is_the_formula(p, m):
    assert bubble_fraction(ONE_F_ONE_B, p, m) == (p - 1) / (m + p - 1)
    assert bubble_fraction(PipelineSchedule.gpipe, p, m) == (p - 1) / (m + p - 1)
    # interleaving v stages per rank shrinks the fill and drain v-fold (Narayanan et al. 2021)
    assert bubble_fraction(PipelineSchedule.interleaved_1f1b, p, m, virtual=4) == (p - 1) / (4 * m + p - 1)
    # zbv: p - 1 idle units against 6m busy once m >= (3p - 1) / 2, 2 (2p - 1 - m) below
    # (test_zbv_bubble_is_its_orders)
    idle = max(p - 1, 2 * (2 * p - 1 - m))
    assert bubble_fraction(PipelineSchedule.zbv, p, m) == idle / (6 * m + idle)


def _zbv_timeline(p: int, m: int) -> float:
    """The idle share of torch's ZB-V order (ScheduleZBVZeroBubble's per-rank actions) run with
    every forward, input-gradient and weight-gradient action taking one unit: each action starts
    when its rank is free and its inputs exist (F after the previous stage's F, I after the next
    stage's I or the last stage's F, W after its I), sends taking no time."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    order = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)  # its order only, no stages
    order.pp_group_size, order._n_microbatches, order.num_stages = p, m, 2 * p
    todo = {r: [a for a in order._calculate_single_rank_operations(r) if a is not None] for r in range(p)}
    done: dict = {}
    free = {r: 0 for r in range(p)}
    while any(todo.values()):
        for r in range(p):
            while todo[r]:
                a = todo[r][0]
                s, k, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == _ComputationType.FORWARD:
                    name, needs = "F", [("F", s - 1, k)] if s > 0 else []
                elif kind == _ComputationType.BACKWARD_INPUT:
                    name, needs = "I", [("I", s + 1, k)] if s < 2 * p - 1 else [("F", s, k)]
                else:
                    name, needs = "W", [("I", s, k)]
                if any(n not in done for n in needs):
                    break
                free[r] = max([free[r]] + [done[n] for n in needs]) + 1
                done[(name, s, k)] = free[r]
                todo[r].pop(0)
    step = max(free.values())
    return 1 - 6 * m / step  # every rank is busy 6m units (2 stages x m x F, I, W)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zbv_bubble_is_its_orders(p):
    for m in range(1, 3 * p + 1):
        assert bubble_fraction(PipelineSchedule.zbv, p, m) == pytest.approx(_zbv_timeline(p, m), abs=1e-12), (p, m)


def test_stages_hold_the_whole_model_once_and_1f1b_loads_the_first_rank_most():
    job = _job("model=llama3_1_8b", "cluster.nodes=2", "cluster.nproc_per_node=8", "data.seq_len=2048")
    job = replace(job, dp_shard=4, micro_batch=1, global_batch=32 * 4)  # one stage's mesh: 4 ranks
    plan = stage_plans(job, 4, ONE_F_ONE_B, 32)
    # Balanced as the trainer cuts it: the head (128256 x 4096, 2.4 blocks' parameters) on the last
    # stage, so 8, 9, 9 and 6 + 2.4 blocks' work (the busiest 9; evenly 8 + 2.4 = 10.4)
    assert [s.layers for s in plan.stages] == [8, 9, 9, 6]
    assert [s.layers for s in plan.stages] == balanced_split([1.0] * 32, 4, 525_340_672 / 218_112_000)
    assert plan.bubble == 3 / 35
    whole = memory(job)
    stage_params, start = [], 0
    for s in plan.stages:
        stage_params.append(memory(stage_job(job, start, start + s.layers, s.first, s.last, 1)).params)
        start += s.layers
    # fp32 shards: every parameter in exactly one stage (padding: one element per unit and rank)
    assert abs(sum(stage_params) - whole.params) <= 4 * 4 * (job.model.n_layers + 4)
    # 1F1B: rank r holds p - r microbatches' activations: the first rank the most
    assert plan.rank_peaks[0] > plan.rank_peaks[1]
    assert plan.stages[0].peak_bytes == plan.rank_peaks[0]


def test_the_split_balances_the_head():
    assert balanced_split([1.0] * 4, 2, 0.35) == [2, 2]  # a head narrower than a block: even
    assert balanced_split([1.0] * 16, 4, 4.4) == [5, 5, 5, 1]  # Llama 3.2 1B's vocabulary at pp=4
    assert balanced_split([1.0] * 126, 8, 0.65) == [16, 16, 16, 16, 16, 16, 15, 15]  # 405B: even


def test_405b_on_64_nodes_of_8_gets_a_pipeline_proposal_with_its_reason():
    job = _job(
        "model=llama3_1_405b",
        "cluster.nodes=64",
        "cluster.nproc_per_node=8",
        "cluster.gpus_per_node=8",
        "parallelism.tp=8",
        "parallelism.param_dtype=bfloat16",
        "data=synthetic",
        "data.seq_len=4096",
        "trainer.micro_batch_size=1",
        "trainer.global_batch_size=512",
    )
    proposal = propose_pipeline(job)
    assert (proposal.pp, proposal.tp, proposal.dp_shard, proposal.microbatches) == (8, 8, 8, 64)
    assert proposal.checkpointing == "full"
    assert proposal.plan.bubble == 7 / 71  # (p-1)/(m+p-1)
    assert proposal.plan.peak_bytes <= job.budget_bytes
    assert proposal.reason.startswith("sharding alone needs 423.7 GiB per rank of 80.0; pp=8 with ")
    assert "9.9% bubble ((p-1)/(m+p-1) at m=64)" in proposal.reason


def test_a_pipeline_job_is_planned_per_stage():
    from framework.planner.plan import make_plan

    cfg = to_config(
        compose_config(
            "stage=plan model=llama3_1_405b cluster.nodes=64 cluster.nproc_per_node=8 cluster.gpus_per_node=8 "
            "parallelism.tp=8 parallelism.pp=8 parallelism.pp_microbatches=64 "
            "parallelism.activation_checkpointing=full "
            "parallelism.param_dtype=bfloat16 data=synthetic data.seq_len=4096 trainer.micro_batch_size=1 "
            "trainer.global_batch_size=512".split()
        )
    )
    result = make_plan(cfg)
    assert result.estimate.fits and result.estimate.job.dp_shard == 8
    note = result.notes[0]
    assert note.startswith("pipeline: pp=8 1f1b, 64 microbatches, 1 stage(s) per rank: bubble 9.9%")
    assert "the figures above are stage 0's (16 layers, the heaviest, on its 64 of the 512 ranks)" in note


PP_JOB = [
    "model=debug",
    "data=synthetic",
    "cluster.nproc_per_node=4",
    "parallelism.pp=2",
    "parallelism.dp_shard=2",
    "parallelism.pp_microbatches=4",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
]
PP_CASES = {
    "1f1b": [],
    "gpipe": ["parallelism.pp_schedule=gpipe"],
    "grad_op": ["parallelism.strategy=grad_op"],
    # rank 0 holds stages 0 and 2 of 4 (one block each)
    "interleaved": [
        "parallelism.pp_schedule=interleaved_1f1b",
        "parallelism.pp_virtual_stages=2",
        "model.args.n_layers=4",
    ],
    # rank 0 holds stages 0 and 3 of 4 (zbv's V): its weight halves run apart from the input
    # halves, each gathering what a forward freed since, which keeps m + 1 gathers
    "zbv": ["parallelism.pp_schedule=zbv", "model.args.n_layers=4"],
}


@pytest.mark.parametrize("case", sorted(PP_CASES))
def test_a_stage_ranks_gathers_are_the_planners(tmp_path, case):
    """The engine's gather and reduction bytes on pipeline rank 0 of a pp=2 x dp_shard=2 job (its
    metrics), each step, equal the planner's traffic of that rank's stages ([Note: gathers of a
    pipeline stage]: m + 1 gathers per unit and step for ZeRO-3, whatever the schedule; one with
    grad_op). Before, the planner counted plain accumulation's 2m (870,400 bytes against the
    625,920 measured for 1f1b)."""
    import json

    from conftest import run_main

    from framework.planner.estimate import traffic

    overrides = PP_JOB + PP_CASES[case]
    steps = ["trainer.max_steps=2", "trainer.log_interval=1", "trainer.eval_interval=0"]
    out = run_main(overrides + steps + [f"hydra.run.dir={tmp_path}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    cfg = to_config(compose_config(["stage=plan", *overrides]))
    p = cfg.parallelism
    job = job_from_config(cfg)
    schedule = PipelineSchedule(p.pp_schedule)
    v = virtual_stages(schedule, p.pp_virtual_stages)
    mine = [sj for rank, sj in stage_jobs(job, p.pp, schedule, p.pp_microbatches, v) if rank == 0]
    planned = [traffic(sj).engine_counters() for sj in mine]
    gathers = sum(t["allgather_bytes"] for t in planned)
    reductions = sum(t["reduce_scatter_bytes"] for t in planned)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["gather_bytes"] == gathers, (case, r, planned)
        assert r["comm_bytes"] == gathers + reductions, (case, r, planned)


def test_zbv_counts_two_recomputations_past_its_first_stage():
    """Under activation checkpointing zbv's input and weight halves each recompute a stage's
    blocks (tests/distributed/test_pipeline_checkpointing.py counts 3 runs per microbatch past the
    first stage, 2 under 1f1b): a stage of equal layers computes 4/3 + 1/3 of its 1f1b time
    (forward 1, backward 2, recomputations 1 or 2, in forwards), and stage 0 (one whole backward)
    its 1f1b time."""
    from framework.planner.estimate import timing

    job = _job(
        "model=llama3_1_8b", "cluster.nodes=2", "cluster.nproc_per_node=8", "parallelism.activation_checkpointing=full"
    )
    zbv = stage_jobs(job, 2, PipelineSchedule.zbv, 8, split=[8, 8, 8, 8])
    one = stage_jobs(job, 4, ONE_F_ONE_B, 8, split=[8, 8, 8, 8])
    assert [sj.recomputations for _, sj in zbv] == [1, 2, 2, 2]
    for s in range(4):
        ratio = timing(zbv[s][1]).compute_s / timing(one[s][1]).compute_s
        assert ratio == pytest.approx(1.0 if s == 0 else (1 + 2 / 3) / (1 + 1 / 3), rel=1e-9), (s, ratio)
