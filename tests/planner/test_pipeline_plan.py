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
    assert bubble_fraction(PipelineSchedule.zbv, p, m) == (p - 1) / (2 * m + p - 1)


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
