"""parallelism.pp and its settings: the degrees, the mesh's order, and each refusal in one line."""

from __future__ import annotations

import pytest
from conftest import TINY, run_main

from framework.config import compose_config, to_config, validate
from framework.config.degrees import resolve_parallel_dims
from framework.config.pipeline import PipelineSchedule, bubble_fraction, even_split, virtual_stages


def cfg_of(*overrides):
    return to_config(compose_config(list(overrides)))


def test_pp_is_a_degree_of_the_world():
    dims = resolve_parallel_dims("full", dp_replicate=1, dp_shard=-1, tp=2, pp=2, world_size=8, nproc_per_node=8)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 1, 2, 2)
    assert dims.dp == 2  # the stages of one sample are not data-parallel ranks


def test_a_pipeline_job_validates_clean():
    cfg = cfg_of(*TINY, "parallelism.pp=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=2")
    assert validate(cfg, world_size=4) == []
    assert cfg.parallelism.pp_schedule == PipelineSchedule.one_f_one_b
    assert cfg_of("parallelism.pp_schedule=interleaved_1f1b").parallelism.pp_schedule.value == "interleaved_1f1b"


@pytest.mark.parametrize(
    "overrides, world, line",
    [
        (
            ["parallelism.pp=3"],
            4,
            "parallelism: cannot infer parallelism.dp_shard: pp (3) x dp_replicate (1) x dp_shard (?) x "
            "tp (1) must equal the world size (4); fix parallelism.pp/dp_replicate/dp_shard/cp/tp or the number "
            "of ranks",
        ),
        (["parallelism.pp=0"], 2, "parallelism.pp=0: must be a positive degree (1: no pipeline)"),
        (
            ["parallelism.pp=2", "parallelism.cp=2"],
            4,
            "parallelism.pp=2 with parallelism.cp=2: pipeline stages do not split sequences yet; set "
            "parallelism.cp=1 or parallelism.pp=1",
        ),
        (
            ["parallelism.pp=2", "parallelism.pp_schedule=zbv", "trainer.eval_interval=10"],
            2,
            "parallelism.pp_schedule=zbv with trainer.eval_interval=10: torch's ZBV schedule has no forward-only "
            "pass for validation; set trainer.eval_interval=0 or pp_schedule=interleaved_1f1b",
        ),
        (
            ["parallelism.pp=2", "parallelism.pp_schedule=zbv", "parallelism.pp_virtual_stages=3"],
            2,
            "parallelism.pp_virtual_stages=3 with parallelism.pp_schedule=zbv: zbv runs exactly 2 stages per rank",
        ),
        (
            ["parallelism.pp=2", "parallelism.pp_virtual_stages=2"],
            2,
            "parallelism.pp_virtual_stages=2 with parallelism.pp_schedule=1f1b: one stage per rank; choose "
            "pp_schedule=interleaved_1f1b or zbv for more",
        ),
        (
            ["parallelism.pp=2", "parallelism.pp_split=[1,1,1]"],
            2,
            "parallelism.pp_split has 3 entries for 2 stages (pp=2 x 1 per rank); give one layer count per stage",
        ),
        (
            ["parallelism.pp=2", "trainer.global_batch_size=8", "trainer.micro_batch_size=8"],
            2,
            "parallelism.pp_microbatches=1 with parallelism.pp=2 and pp_schedule=1f1b: the schedule needs at "
            "least one microbatch per stage rank; raise pp_microbatches (or the accumulation steps) to >= pp",
        ),
        (
            ["parallelism.pp=2", "trainer.global_batch_size=8", "parallelism.pp_microbatches=3"],
            2,
            "parallelism.pp_microbatches=3 does not divide the 8 samples each data-parallel rank trains on per "
            "step (trainer.global_batch_size / dp); choose a divisor",
        ),
    ],
)
def test_each_problem_is_one_line(overrides, world, line):
    problems = validate(cfg_of(*TINY, *overrides), world_size=world)
    assert line in problems, problems


def test_an_unknown_schedule_is_refused_naming_the_choices():
    from framework.errors import UserInputError

    with pytest.raises(UserInputError) as exc:
        cfg_of("parallelism.pp_schedule=looped")
    assert str(exc.value) == (
        "parallelism.pp_schedule='looped': unknown; choose one of gpipe, 1f1b, interleaved_1f1b, zbv"
    )


def test_a_refused_pipeline_exits_2_with_its_line(tmp_path):
    overrides = ["parallelism.pp=2", "parallelism.cp=2", "cluster.nproc_per_node=4"]
    out = run_main([*TINY, *overrides, f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "parallelism.pp=2 with parallelism.cp=2: pipeline stages do not split sequences" in out.stdout + out.stderr
    assert not (tmp_path / "run").exists()


def test_arithmetic():
    assert even_split(5, 2) == [3, 2] and even_split(4, 4) == [1, 1, 1, 1]
    assert virtual_stages(PipelineSchedule.zbv, -1) == 2 and virtual_stages(PipelineSchedule.gpipe, -1) == 1
    assert bubble_fraction(PipelineSchedule.one_f_one_b, 4, 8) == 3 / 11
    assert bubble_fraction(PipelineSchedule.interleaved_1f1b, 4, 8, virtual=2) == 3 / 19
    assert bubble_fraction(PipelineSchedule.gpipe, 1, 8) == 0.0
