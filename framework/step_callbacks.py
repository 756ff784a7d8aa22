"""What runs around the training loop's steps, each a callback with the same hooks: in-memory
snapshots (checkpoint.memory_interval), checkpoints, the metrics log with its trackers, and the
profiler. The trainer calls `start` in list order before the first step, and the ending hooks
(`end_step`, `finish`, `close`) in reverse order, so what started first ends last.
"""

from __future__ import annotations

from typing import Dict

import torch.distributed as dist

from framework.errors import UserInputError
from framework.metrics import MetricsLogger
from framework.profiling import StepProfiler


class StepCallback:
    """Every hook optional; `trainer` is the running framework.trainer.Trainer."""

    def start(self, trainer) -> None:
        """Before the first step (every rank)."""

    def reads(self, step: int) -> bool:
        """Whether `step` must read its loss before the optimizer step (a save never passes a non-finite one)."""
        return False

    def after_step(self, trainer, step: int) -> None:
        """Right after the step's work, before its logging and evaluation."""

    def metrics(self) -> Dict[str, float]:
        """Added to a logged step's record."""
        return {}

    def end_step(self, trainer, step: int) -> None:
        """After the step is logged and the ranks agreed not to stop."""

    def finish(self, trainer) -> None:
        """The run reached trainer.max_steps."""

    def close(self) -> None:
        """Always, at the end of `fit`, whatever happened."""


class Snapshots(StepCallback):
    """In-memory snapshots (framework/checkpoint/memory.py): the newest every rank has, else the
    disk, restores the state; one taken after every step the interval names."""

    def __init__(self, memory, ckpt):
        self.memory, self.ckpt = memory, ckpt

    def start(self, trainer):
        trainer.state.step = self.memory.restore(trainer.state, self.ckpt)

    def metrics(self):
        return self.memory.metrics()  # the snapshots' cost, the restore's source and time

    def end_step(self, trainer, step):
        self.memory.snapshot(trainer.state)

    def finish(self, trainer):
        self.memory.close(finished=True)

    def close(self):
        self.memory.wait()


class Checkpoints(StepCallback):
    """checkpoint.* (framework/checkpoint/manager.py): the resume (unless the snapshots restore),
    saves on the interval's steps, the final save and export."""

    def __init__(self, ckpt, resumes: bool):
        self.ckpt, self.resumes = ckpt, resumes

    def start(self, trainer):
        if self.resumes:
            trainer.state.step = self.ckpt.resume(trainer.state)

    def reads(self, step):
        return self.ckpt.should_save(step)

    def end_step(self, trainer, step):
        if self.ckpt.should_save(step):
            self.ckpt.save(trainer.state)
            trainer.logger.plot()

    def finish(self, trainer):
        self.ckpt.finish(trainer.state)

    def close(self):
        self.ckpt.close()


class MetricsLog(StepCallback):
    """metrics.jsonl, the progress bar, the loss plot and rank 0's trackers (framework/trackers.py);
    `started()` runs once the trackers are open, before the first step."""

    def __init__(self, started=None):
        self.started, self.logger = started, None

    def start(self, trainer):
        cfg, t, rt = trainer.cfg, trainer.cfg.trainer, trainer.rt
        trackers = open_trackers(cfg, rt, resumed=trainer.state.step > 0)
        if self.started is not None:
            try:
                self.started()
            except BaseException:
                if trackers is not None:
                    trackers.close()
                raise
        trainer.logger = self.logger = MetricsLogger(
            cfg.run_dir,
            enabled=rt.is_main,
            total_steps=t.max_steps,
            start_step=trainer.state.step,
            jsonl=cfg.logging.jsonl,
            progress_bar=t.progress_bar,
            log_interval=t.log_interval,
            trackers=trackers,
            loss_plot=cfg.logging.loss_plot,
            tokens_per_step=trainer.tokens_per_step,
        )
        self.logger.write(trainer.describe())
        if trainer.state.step:
            self.logger.write(f"resumed at step {trainer.state.step}")

    def close(self):
        if self.logger is not None:
            self.logger.plot()  # the end of the run, or as far as it got
            self.logger.close()


class Profiler(StepCallback):
    """trainer.profile (framework/profiling.py): its schedule counts the steps from the first."""

    def __init__(self):
        self.profiler = None

    def start(self, trainer):
        t, rt = trainer.cfg.trainer, trainer.rt
        self.profiler = StepProfiler(
            t.profile, trainer.cfg.run_dir, rt.rank, rt.device, t.profile_wait, t.profile_warmup, t.profile_active
        )

    def after_step(self, trainer, step):
        self.profiler.step()

    def close(self):
        if self.profiler is not None:
            self.profiler.close()


def open_trackers(cfg, rt, resumed: bool):
    """Rank 0's trackers (framework/trackers.py); the ranks agree on whether they started, so a
    tracker that cannot start ends every rank with one line and status 2 before the first step."""
    if not (cfg.logging.tensorboard or cfg.logging.wandb.enabled or cfg.logging.mlflow.enabled):
        return None
    trackers, problem = None, None
    if rt.is_main:
        from omegaconf import OmegaConf

        from framework.trackers import open_trackers as open_rank0

        config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
        try:
            trackers = open_rank0(cfg.logging, cfg.run_dir, config, resumed=resumed)
        except UserInputError as exc:
            problem = str(exc)
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UserInputError(verdict[0])
    return trackers
