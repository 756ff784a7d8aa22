"""`stage=evaluate`: lm-eval-harness tasks on a checkpoint or an export (framework/downstream.py).

    python main.py stage=evaluate checkpoint.init_from=runs/exp1/checkpoints/export \\
        'evaluate.tasks=[my_task]' evaluate.include_path=tasks/ evaluate.num_fewshot=2
"""

from __future__ import annotations

from framework.downstream import run_tasks
from framework.errors import UserInputError


def _evaluate_stage(trainer) -> int:
    """The stage on a built trainer (every rank): load the weights, run the tasks. Refusals raise."""
    cfg = trainer.cfg
    if not cfg.evaluate.tasks:
        raise UserInputError("stage=evaluate needs evaluate.tasks=[<lm-eval task>, ...] (and evaluate.include_path)")
    step = trainer.load_weights("evaluate")
    trackers = trainer.open_trackers()  # every rank: they agree on whether the trackers started
    try:
        run_tasks(trainer, list(cfg.evaluate.tasks), step, trackers)
    finally:
        if trackers is not None:
            trackers.close()
        trainer.ckpt.close()
    return 0


def run_evaluate(cfg, record=None) -> int:
    """Every rank: the training job's build and failure handling, with evaluation in place of
    training; rank 0 then `record`s the job's config. Exit status."""
    from framework.trainer import run

    return run(cfg, body=_evaluate_stage, record=record)
