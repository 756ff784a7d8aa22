"""What the ranks would refuse, found before any rank starts: the checks that need more than the
config's own fields (framework/config/validate.py has those). `framework/entrypoint.py` runs them
for every stage that starts ranks, so a refusal costs a second, not a build of the model and a
process group (an unknown lm-eval task took 47 s to be refused in the ranks, an MLflow address
where nothing listens 17 s):

- lm-eval task names (evaluate.tasks, trainer.eval_tasks) against evaluate.include_path and
  lm-eval's own tasks, read without lm-eval ([Note: indexing lm-eval's tasks without lm-eval]);
- the task files those tasks load are readable YAML (lm-eval's index skips one that is not, and
  the ranks then said the task does not exist), and the code they name is refused unless
  evaluate.trust_task_code=true ([Note: task files that run code] in framework/task_files.py);
- the MLflow server of an http(s) tracking URI accepts a connection (framework/trackers.py). Under
  torchrun this is left to rank 0's own tracker start, which the ranks agree on: a rank on another
  node may not reach the server rank 0 reaches, and the ranks must refuse together;
- stage=generate's output file is a new one in an existing directory;
- the tokenizer the data was prepared with against a Hugging Face model's own (model.path), by
  their token tables ([Note: the data's tokenizer against the model's] in framework/data/tokenizer.py);
- memory snapshots (checkpoint.memory_interval) only where something restarts the ranks: torchrun
  with --max-restarts above 0 ([Note: snapshots need a restart] in framework/config/validate.py).
"""

from __future__ import annotations

import os
from typing import List

from framework.config import DataName, Stage
from framework.config.validate import restarts_here, snapshots_without_restarts
from framework.task_files import code_problem, lm_eval_tasks_dir, unknown_tasks, unparsable_files, unreadable_task_file
from framework.trackers import TOOLS_LOCK, unreachable


def preflight_problems(cfg, torchrun: bool) -> List[str]:
    """Every problem found, one line each, naming the field and the fix."""
    problems = task_problems(cfg)
    if cfg.stage == Stage.generate:
        problem = generate_output_problem(cfg)
        if problem:
            problems.append(problem)
    if cfg.stage != Stage.fine_tuning:  # which tokenizes its records itself, and checks their ids
        from framework.data.tokenizer import data_tokenizer_problem

        problem = data_tokenizer_problem(cfg.data, cfg.model.path)
        if problem:
            problems.append(problem)
    if not torchrun:
        problem = unreachable(cfg.logging)
        if problem:
            problems.append(problem)
    if cfg.stage in (Stage.training, Stage.fine_tuning, Stage.dpo, Stage.grpo):  # the stages that snapshot
        problem = snapshots_without_restarts(cfg.checkpoint.memory_interval, restarts_here(torchrun))
        if problem:
            problems.append(problem)
    return problems


def task_problems(cfg) -> List[str]:
    """The lm-eval tasks this job would run: they exist, and their files name no code unless the
    user trusts them."""
    e = cfg.evaluate
    if cfg.stage == Stage.evaluate:
        field, names = "evaluate.tasks", list(e.tasks)
        if not names:
            return ["stage=evaluate needs evaluate.tasks=[<lm-eval task>, ...] (and evaluate.include_path)"]
    elif cfg.stage == Stage.generate:
        return []
    else:
        field, names = "trainer.eval_tasks", list(cfg.trainer.eval_tasks)
    if not names:
        return []
    if cfg.stage in (Stage.training, Stage.evaluate) and cfg.data.name in (DataName.synthetic, DataName.digits):
        return [
            f"{field}: lm-eval tasks need a tokenizer, and data={cfg.data.name.value} has none; use data=stdlib, "
            "data=hf or data=indexed (with its tokenizer)"
        ]
    if e.include_path and not os.path.isdir(e.include_path):
        return [f"evaluate.include_path={e.include_path}: no such directory of task YAMLs"]
    if lm_eval_tasks_dir() is None:
        return [f"{field} needs the lm-eval package: {TOOLS_LOCK}"]
    unknown = unknown_tasks(names, e.include_path)
    if unknown:
        unread = unparsable_files(e.include_path) if e.include_path else []
        hint = f"; {unread[0][0]} cannot be read: {unread[0][1]}" if unread else ""
        return [
            f"{field}: no lm-eval task {', '.join(unknown)}; local tasks: a YAML in evaluate.include_path "
            f"(`lm-eval ls tasks` lists lm-eval's own){hint}"
        ]
    if not e.include_path:
        return []
    problem = unreadable_task_file(names, e.include_path)
    if problem is None and not e.trust_task_code:
        problem = code_problem(e.include_path, names)
    return [problem] if problem else []


def generate_output_problem(cfg) -> str:
    """generate.output_file's refusal ("" when none): a new file in an existing directory."""
    path = cfg.generate.output_file
    if not path:
        return ""
    if os.path.lexists(path):
        return f"generate.output_file={path}: exists; name a new file (completions never replace a file)"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"generate.output_file={path}: no directory {parent}; create it or name a file in an existing one"
    return ""
