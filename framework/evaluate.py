"""`stage=evaluate`: lm-eval-harness tasks on a checkpoint or an export (framework/downstream.py).

    python main.py stage=evaluate checkpoint.init_from=runs/exp1/checkpoints/export \\
        'evaluate.tasks=[my_task]' evaluate.include_path=tasks/ evaluate.num_fewshot=2

The model is the job of framework/job.py (built as for training, no optimizer), its weights the
checkpoint's or the export's.
"""

from __future__ import annotations

from framework.downstream import run_tasks
from framework.errors import UserInputError
from framework.job import load_trained_weights
from framework.step_callbacks import open_trackers


def evaluate_stage(job) -> int:
    """The stage on a built job (every rank): load the weights, run the tasks. Refusals raise."""
    cfg = job.cfg
    if not cfg.evaluate.tasks:
        raise UserInputError("stage=evaluate needs evaluate.tasks=[<lm-eval task>, ...] (and evaluate.include_path)")
    step = load_trained_weights(job, "evaluate")
    trackers = open_trackers(cfg, job.rt, resumed=False)  # every rank: they agree on whether they started
    try:
        run_tasks(job, list(cfg.evaluate.tasks), step, trackers)
    finally:
        if trackers is not None:
            trackers.close()
    return 0
