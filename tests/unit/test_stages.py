"""The stages are records in one table (framework/stages.py), looked up by the entry point and the
trainer; no stage subclasses the trainer, and only the step runner (framework/steps.py) knows
whether the layout is a pipeline."""

import ast

from conftest import REPO


def test_every_stage_choice_has_one_record_found_by_enum_and_name():
    from framework.config.schema import Stage
    from framework.stages import STAGES, stage_of

    assert sorted(STAGES) == sorted(s.value for s in Stage)
    for choice in Stage:
        assert stage_of(choice) is stage_of(choice.value) is STAGES[choice.value]
        record = stage_of(choice)
        # a stage starts ranks (a body or an objective) or runs in this process, never both
        assert (record.local is None) == (record.body is not None or record.objective is not None), record
        assert record.body is None or record.objective is None, record


def test_the_records_say_what_each_stage_needs_and_writes():
    from framework.stages import stage_of
    from framework.trainer import Objective

    trains = {"training", "fine_tuning", "dpo", "grpo"}
    for name in ("training", "fine_tuning", "dpo", "grpo", "generate", "evaluate", "plan", "data_preparation"):
        record = stage_of(name)
        assert record.needs_optimizer == (name in trains), name
        assert record.config_file == ("config.yaml" if name in trains else f"config.{name}.yaml")
        if record.objective is not None:  # the loss (or rollout then loss) and what it evaluates
            assert issubclass(record.load("objective"), Objective) and record.evaluates, name
    assert stage_of("training").load("data_builder") is None  # the data section's
    assert [n for n in ("training", "generate", "evaluate", "plan", "data_preparation") if stage_of(n).runs_tasks] == [
        "evaluate"
    ]
    assert not stage_of("plan").refuses and stage_of("generate").refuses  # the plan shows its problems
    assert not stage_of("data_preparation").checks_model and stage_of("grpo").checks_model
    from framework.dpo.data import build_dpo_data
    from framework.dpo.stage import DPOObjective
    from framework.generate import generate_stage

    assert stage_of("dpo").load("data_builder") is build_dpo_data
    assert stage_of("dpo").load("objective") is DPOObjective
    assert stage_of("generate").load("body") is generate_stage


def test_no_class_subclasses_the_trainer_and_the_trainer_never_asks_for_a_pipeline():
    source = (REPO / "framework" / "trainer.py").read_text()
    assert source.count("pipeline") <= 1
    for path in (REPO / "framework").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                assert "Trainer" not in bases, f"{path}: class {node.name} subclasses Trainer"


def test_a_stage_record_crosses_to_a_spawned_rank():
    """spawn_local on an accelerated build pickles the rank's entry, the stage record with it."""
    import pickle

    from framework.stages import STAGES

    for record in STAGES.values():
        assert pickle.loads(pickle.dumps(record)) == record
