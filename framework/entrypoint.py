"""From a composed config to running ranks: validation, the run directory, local rank start."""

from __future__ import annotations

import os
import sys
from typing import List

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.run_lock import lock_run_dir
from framework.config import Stage, to_config, validate
from framework.errors import EXIT_BAD_INPUT, UserInputError
from framework.runtime import run_rank, spawn_local, under_torchrun


def fix_run_dir_under_torchrun(argv: List[str]) -> List[str]:
    """Under torchrun every rank composes its own config, and Hydra's default run directory is a
    timestamp that may differ between ranks: give them all one directory, named by the rendezvous,
    unless the user (or the launcher) chose `hydra.run.dir`."""
    if not under_torchrun() or any(a.startswith("hydra.run.dir=") for a in argv):
        return argv
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id == "none":
        run_id = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return argv + [f"hydra.run.dir=outputs/torchrun/{run_id}"]


def _refuse(problems: List[str], run_dir: str) -> int:
    if os.environ.get("RANK", "0") == "0":
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
    # Hydra created the run directory before calling us; leave no trace of a refused job.
    try:
        os.removedirs(run_dir)  # removes only empty directories, walking up while they are empty
    except OSError:
        pass
    return EXIT_BAD_INPUT


def start(dict_cfg: DictConfig, run_dir: str) -> int:
    """Validate, record the resolved config, then run the stage on every rank."""
    try:
        cfg = to_config(dict_cfg)
    except UserInputError as exc:  # a section's own check; anything else is a bug (see errors.py)
        return _refuse([str(exc)], run_dir)
    problems = validate(cfg)
    if cfg.stage != Stage.data_preparation:
        from framework.models.args import job_model_problems
        from framework.models.registry import check_model

        problems += job_model_problems(cfg)  # the model's arguments against the job (no torch)
        problems += [p for p in check_model(cfg.model) if p not in problems]  # the family's own refusals
    if problems and cfg.stage != Stage.plan:  # the plan shows them beside the numbers
        return _refuse(problems, run_dir)
    cfg.run_dir = os.path.abspath(run_dir)
    if os.environ.get("RANK", "0") == "0":
        try:  # one job per run directory; see [Note: the run directory lock]
            lock_run_dir(cfg.run_dir)
        except UserInputError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        OmegaConf.save(dict_cfg, os.path.join(cfg.run_dir, "config.yaml"), resolve=True)
    if cfg.stage == Stage.plan:
        from framework.planner import run_plan

        return run_plan(cfg, problems)
    if cfg.stage == Stage.data_preparation:
        from framework.data.prepare import prepare_data

        return prepare_data(cfg)

    from framework.trainer import run

    if under_torchrun() or cfg.cluster.nproc_per_node == 1:
        return run_rank(run, cfg)  # a crash prints its rank and traceback (and torchrun's error file)
    return spawn_local(run, cfg, cfg.cluster.nproc_per_node)
