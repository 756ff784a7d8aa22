"""The stages, described once: everything the entry point and the trainer ask of a stage, per stage.

`stage=<name>` names one of `STAGES`. framework/entrypoint.py and the trainer look the record up
with `stage_of(cfg.stage)` and never compare stage names:

    stage = stage_of(cfg.stage)
    stage.config_file          # where a finished job records its resolved config
    run(cfg, stage, ...)       # framework/trainer.py, on every rank: the job (framework/job.py) on
                               # the stage's data, then the trainer's loop with the stage's
                               # objective, or the stage's body on the job (no optimizer)

A record names its code as "module:attribute", imported by `load` when used: importing this
module is cheap ([Note: no torch before the config is accepted] in framework/entrypoint.py) and a
record crosses to a spawned rank as plain strings. Adding a stage is one more record here (plus its
name among the config's `Stage` choices, which the config checks without importing torch).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Dict, Optional

from framework.config.schema import Stage


@dataclass(frozen=True)
class StageRecord:
    name: str
    # (cfg, *, dp_rank, dp_size) -> DataBundle: the stage's data; None: the data section's
    data_builder: Optional[str] = None
    # the stage's Objective (framework/trainer.py): its loss (or rollout then loss), what it
    # evaluates, its step metrics; set for a stage that trains (it needs an optimizer)
    objective: Optional[str] = None
    # (job) -> exit status: a stage that uses a trained model, run on its job with no optimizer
    body: Optional[str] = None
    # (cfg, problems) -> exit status: a stage that runs in the launching process, no ranks
    local: Optional[str] = None
    evaluates: str = ""  # what trainer.eval_interval reports
    checks_model: bool = True  # the model's arguments are checked against the job before it starts
    runs_tasks: bool = False  # runs lm-eval tasks whatever trainer.eval_tasks says (writes <run>/eval)
    refuses: bool = True  # a problem found before the start refuses the job (the plan shows them instead)

    @property
    def needs_optimizer(self) -> bool:
        return self.objective is not None

    @property
    def trains(self) -> bool:
        """A training stage: the run's own config.yaml, checkpoints under checkpoint.dir."""
        return self.needs_optimizer

    @property
    def config_file(self) -> str:
        """The file a job of this stage records its resolved config in: see [Note: one config.yaml per run]."""
        return "config.yaml" if self.trains else f"config.{self.name}.yaml"

    def load(self, field: str):
        """The code `field` names, imported now (None where the record names none)."""
        where = getattr(self, field)
        if where is None:
            return None
        module, _, attribute = where.partition(":")
        return getattr(importlib.import_module(module), attribute)


_LM = "framework.trainer:Objective"  # language modelling: the task's loss

STAGES: Dict[str, StageRecord] = {
    record.name: record
    for record in (
        StageRecord("training", objective=_LM, evaluates="val_loss and the task's metrics on the validation data"),
        StageRecord(
            "fine_tuning",
            data_builder="framework.finetune.build:build_finetune_data",
            objective=_LM,
            evaluates="val_loss on the validation records (response tokens only)",
        ),
        StageRecord(
            "dpo",
            data_builder="framework.dpo.data:build_dpo_data",
            objective="framework.dpo.stage:DPOObjective",
            evaluates="val_loss and the pairs' statistics (val_rewards/...)",
        ),
        StageRecord(
            "grpo",
            data_builder="framework.grpo.data:build_grpo_data",
            objective="framework.grpo.stage:GRPOObjective",
            evaluates="val_reward: one greedy completion of each validation prompt",
        ),
        StageRecord("generate", body="framework.generate:generate_stage"),
        StageRecord("evaluate", body="framework.evaluate:evaluate_stage", runs_tasks=True),
        StageRecord("plan", local="framework.planner:run_plan", refuses=False),
        StageRecord("data_preparation", local="framework.stages:prepare_data", checks_model=False),
    )
}


def stage_of(name) -> StageRecord:
    """The record `stage` names (a config `Stage` or its string value)."""
    return STAGES[getattr(name, "value", name)]


def prepare_data(cfg, problems) -> int:
    """stage=data_preparation (framework/data/prepare.py), as a local stage is called."""
    from framework.data.prepare import prepare_data as prepare

    return prepare(cfg)


assert sorted(STAGES) == sorted(s.value for s in Stage), "every stage choice has one record"
