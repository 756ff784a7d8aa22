"""The planner's pipeline figures: the bubble against its formula, memory per stage against the
whole model's, and the proposal of pp for Llama 3.1 405B on 64 nodes x 8 GPUs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from framework.config import compose_config, to_config
from framework.config.pipeline import PipelineSchedule, balanced_split, bubble_fraction
from framework.planner.estimate import memory
from framework.planner.pipeline import propose_pipeline, stage_job, stage_plans
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
