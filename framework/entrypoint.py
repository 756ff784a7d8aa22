"""From a composed config to running ranks: validation, the run directory, local rank start."""

from __future__ import annotations

import functools
import os
import sys
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.run_lock import entries, leave_as_found, lock_run_dir, remove_empty_run_dir
from framework.config import to_config, validate
from framework.errors import EXIT_BAD_INPUT, UserInputError
from framework.stages import stage_of

# [Note: no torch before the config is accepted]
# A refused config, and every refusal found before any rank starts (framework/preflight.py), is
# said in about a second: torch (and whatever imports it) is imported only once the job runs.
# This module, framework/config and the checks run before the ranks import it lazily;
# tests/integration/test_refused_before_ranks.py checks it with `python main.py` itself.


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ


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
    remove_empty_run_dir(run_dir)
    return EXIT_BAD_INPUT


def run_dir_link_problems(cfg, run_dir: str) -> List[str]:
    """The directories this job writes into that are links it must not follow ([Note: a directory
    link is followed only if it is yours] in framework/fileio.py): `checkpoint.dir` for a stage
    that trains, `<run>/eval` for one that runs lm-eval tasks."""
    from framework.fileio import directory_link_problem

    stage = stage_of(cfg.stage)
    checks, trains = [], stage.trains
    if trains:
        c = cfg.checkpoint
        checks.append((os.path.join(run_dir, c.dir), f"checkpoint.dir={c.dir}"))  # join keeps an absolute dir
    if stage.runs_tasks or (trains and cfg.trainer.eval_tasks):
        checks.append((os.path.join(run_dir, "eval"), "hydra.run.dir"))
    return [p for p in (directory_link_problem(path, field) for path, field in checks) if p]


def claim_run_dir(run_dir: str) -> Optional[str]:
    """Take the run directory's lock (see [Note: the run directory lock]); the refusal's text if the
    directory is taken or a file there is planted."""
    try:
        lock_run_dir(run_dir)
    except UserInputError as exc:
        return str(exc)
    return None


# [Note: one config.yaml per run]
# `<run>/config.yaml` is the resolved config of the run the directory holds: its training (or
# fine-tuning) job, written by rank 0 once the job is past everything it refuses (the build, the
# data, the resume, the trackers), just before the first step; a requeued or resumed run rewrites
# it with the settings it runs on. Any other stage run in that directory later (the README's
# `stage=generate checkpoint.resume=auto hydra.run.dir=runs/exp1`, stage=evaluate, plan, data
# preparation) records its config as `config.<stage>.yaml`, once it has finished, and a job refused
# anywhere (before the ranks start or inside them) writes neither, so the run's own record is never
# replaced by a job that did not run it.


def record_config(run_dir: str, name: str, config_yaml: str) -> None:
    """Write `<run_dir>/<name>` (never through a planted link: framework/fileio.py)."""
    from framework.fileio import replace_file

    with replace_file(os.path.join(run_dir, name)) as f:
        f.write(config_yaml)


def _recorded(code: int, record) -> int:
    """A stage run in this process: its config recorded if it finished (status 0)."""
    if code == 0:
        try:
            record()
        except UserInputError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    return code


def start(dict_cfg: DictConfig, run_dir: str) -> int:
    """Validate, record the resolved config, then run the stage on every rank."""
    from framework.checkpoint.shm_names import sweep_job_start
    from framework.offline import hub_offline

    hub_offline()  # for this process and every rank: [Note: offline whatever the environment says]
    # Memory snapshots of jobs killed whole (their sweeper with them), whatever this job is and
    # whether or not it is refused: [Note: snapshot segments outlive the rank, not the job]
    memory_dir = OmegaConf.select(dict_cfg, "checkpoint.memory_dir", default=None)
    sweep_job_start(memory_dir if isinstance(memory_dir, str) else None)
    try:
        cfg = to_config(dict_cfg)
    except UserInputError as exc:  # a section's own check; anything else is a bug (see errors.py)
        return _refuse([str(exc)], run_dir)
    problems = validate(cfg)
    stage = stage_of(cfg.stage)
    if stage.checks_model:
        from framework.models.checks import check_model
        from framework.models.families import job_model_problems

        problems += job_model_problems(cfg)  # the model's arguments against the job (no torch)
        problems += [p for p in check_model(cfg.model) if p not in problems]  # the family's own refusals
    if stage.local is None:  # a stage that starts ranks
        from framework.preflight import preflight_problems

        problems += preflight_problems(cfg, under_torchrun())  # what the ranks would refuse, found now
    problems += run_dir_link_problems(cfg, run_dir)
    if problems and stage.refuses:  # the plan shows them beside the numbers
        return _refuse(problems, run_dir)
    cfg.run_dir = os.path.abspath(run_dir)
    found = entries(cfg.run_dir)  # [Note: a refused job leaves the run directory as it found it]
    try:
        code = _run(cfg, dict_cfg, problems)
    except SystemExit as exc:  # a refusal that ends the rank with its status (checkpoint loading's)
        if exc.code == EXIT_BAD_INPUT:
            leave_as_found(cfg.run_dir, found)
        raise
    if code == EXIT_BAD_INPUT:
        leave_as_found(cfg.run_dir, found)
    return code


def _run(cfg, dict_cfg: DictConfig, problems: List[str]) -> int:
    """Claim the run directory and run the stage: in this process, on local ranks, or as this
    torchrun rank."""
    from framework.local_ranks import spawn_local
    from framework.runtime import run_rank
    from framework.trainer import run

    stage = stage_of(cfg.stage)
    # written by rank 0 when the job is past its refusals ([Note: one config.yaml per run])
    record = functools.partial(record_config, cfg.run_dir, stage.config_file, OmegaConf.to_yaml(dict_cfg, resolve=True))
    if under_torchrun() and stage.trains:
        # Every rank is its own process: rank 0 claims the run directory once the ranks can talk,
        # and a refusal there ends every rank with the same status (trainer.run).
        claim = lambda: claim_run_dir(cfg.run_dir)  # noqa: E731
        return run_rank(functools.partial(run, stage=stage, claim=claim, record=record), cfg)
    if os.environ.get("RANK", "0") == "0":
        problem = claim_run_dir(cfg.run_dir)
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
    if stage.local is not None:  # the plan, data preparation: in this process
        return _recorded(stage.load("local")(cfg, problems), record)
    rank = functools.partial(run, stage=stage, record=record)  # rank 0 records the config
    if under_torchrun() or cfg.cluster.nproc_per_node == 1:
        return run_rank(rank, cfg)  # a crash prints its rank and traceback (and torchrun's error file)
    return spawn_local(rank, cfg, cfg.cluster.nproc_per_node)
