"""From a composed config to running ranks: validation, the run directory, local rank start."""

from __future__ import annotations

import functools
import os
import sys
from typing import List, Optional

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
    # Every rank composed the same config and refuses it; the first rank of each node says why,
    # so every node's log has the reason (not only the node of global rank 0).
    if os.environ.get("LOCAL_RANK", "0") == "0":
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
    # Hydra created the run directory before calling us; leave no trace of a refused job.
    try:
        os.removedirs(run_dir)  # removes only empty directories, walking up while they are empty
    except OSError:
        pass
    return EXIT_BAD_INPUT


def claim_run_dir(run_dir: str, config_yaml: str) -> Optional[str]:
    """Take the run directory's lock (see [Note: the run directory lock]) and record the resolved
    config there; the refusal's text if the directory is taken or a file there is planted."""
    from framework.fileio import create_temporary

    try:
        lock_run_dir(run_dir)
        path = os.path.join(run_dir, "config.yaml")
        with create_temporary(path + ".tmp") as f:  # never through a link planted as config.yaml
            f.write(config_yaml)
        os.replace(path + ".tmp", path)
    except UserInputError as exc:
        return str(exc)
    return None


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
    config_yaml = OmegaConf.to_yaml(dict_cfg, resolve=True)
    if under_torchrun() and cfg.stage not in (Stage.plan, Stage.data_preparation, Stage.generate, Stage.evaluate):
        # Every rank is its own process: rank 0 claims the run directory once the ranks can talk,
        # and a refusal there ends every rank with the same status (trainer.run).
        from framework.trainer import run

        return run_rank(functools.partial(run, claim=lambda: claim_run_dir(cfg.run_dir, config_yaml)), cfg)
    if os.environ.get("RANK", "0") == "0":
        problem = claim_run_dir(cfg.run_dir, config_yaml)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    if cfg.stage == Stage.plan:
        from framework.planner import run_plan

        return run_plan(cfg, problems)
    if cfg.stage == Stage.data_preparation:
        from framework.data.prepare import prepare_data

        return prepare_data(cfg)

    from framework.trainer import run

    if cfg.stage == Stage.generate:
        from framework.generate import run_generate

        run = run_generate  # noqa: F811 - the same per-rank entry shape as training's
    if cfg.stage == Stage.evaluate:
        from framework.evaluate import run_evaluate

        run = run_evaluate  # noqa: F811
    if under_torchrun() or cfg.cluster.nproc_per_node == 1:
        return run_rank(run, cfg)  # a crash prints its rank and traceback (and torchrun's error file)
    return spawn_local(run, cfg, cfg.cluster.nproc_per_node)
