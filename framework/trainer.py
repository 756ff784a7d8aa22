"""The training loop on a built job (framework/job.py): the optimizer, the step's tail, and the
loop. A stage supplies its objective (framework/stages.py): the loss of a micro-batch, or a
rollout then its loss, what it evaluates, and its step metrics; the job's step runner
(framework/steps.py) runs the micro-batches on the layout; checkpoints, snapshots, the metrics
log and the profiler are step callbacks (framework/step_callbacks.py)."""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from framework.config.schema import Config
from framework.distributed.tensor_parallel import full
from framework.errors import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_DIVERGED, UserInputError
from framework.job import Job, build_job, checkpoints_of
from framework.metrics import LossWatch, TrainingDiverged, device_peak_tflops, peak_memory_gib, throughput
from framework.models.tasks import RunView, to_device
from framework.optim import build_optimizer, build_scheduler
from framework.runtime import Runtime, forget_crash, init_distributed, report_crash, shutdown
from framework.step_callbacks import Checkpoints, MetricsLog, Profiler, Snapshots
from framework.stop import StopPolicy
from framework.train_state import TrainState


@dataclass
class StepWork:
    """One optimizer step's work as a stage gives it: `passes` forward-backward passes over `accum`
    micro-batches (`micro`, on the device; None: drawn from the training loader), each followed by
    the trainer's step tail; `loss(batch)` each micro-batch's; `routed`: a mixture-of-experts
    model's routers count and balance them."""

    loss: Callable
    accum: int
    micro: Optional[list] = None
    passes: int = 1
    routed: bool = True


class Objective:
    """What a stage adds to the loop; this one is language modelling's (pre-training, SFT): the
    task's loss, the validation loss and the task's metrics. A stage with its own (stage=dpo's,
    stage=grpo's) overrides what differs; none overrides the step itself."""

    def __init__(self, trainer: "Trainer"):
        self.trainer, self.job = trainer, trainer.job
        self.loss = trainer.job.runner.task_loss(trainer.job.task)
        self.end_of_run = trainer.job.task.end_of_run  # the task's showing of the trained model

    def start(self) -> None:
        """Before any resume (a reference model takes the starting weights here)."""

    def work(self, step: int) -> StepWork:
        return StepWork(self.loss, self.job.data.train.accum_steps)

    def step_metrics(self, read: bool) -> Dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`val_loss`: the mean loss over the same validation samples every time (`eval_iters`
        global batches from the start of the validation set, split over the data-parallel ranks
        like training); and the task's own numbers (`val_<name>`: accuracy, ...) over those
        batches, or the whole split when its loader can give it (`whole_split`)."""
        job, iters = self.job, self.job.cfg.trainer.eval_iters
        job.model.eval()
        valid, device = job.data.valid, job.rt.device
        valid.load_state_dict({"consumed_samples": 0})
        batches = [valid.next_batch() for _ in range(iters * valid.accum_steps)]
        total = job.runner.eval_total(batches, valid.accum_steps, self.loss, device)
        out = {"val_loss": float(world_mean(total)) / (iters * valid.accum_steps)}
        if job.task.metrics is not None and job.runner.whole_model:
            if hasattr(valid, "whole_split"):
                batches = valid.whole_split()
            sums: dict[str, torch.Tensor] = {}
            for batch in batches:
                for name, (value, count) in job.task.metrics(job.model, to_device(batch, device)).items():
                    pair = torch.stack([full(value).float(), count.float()])
                    sums[name] = sums[name] + pair if name in sums else pair
            for name, pair in sorted(sums.items()):
                dist.all_reduce(pair)  # tensor-parallel ranks would count twice: same ratio
                out[f"val_{name}"] = float(pair[0] / pair[1].clamp(min=1))
        job.model.train()
        return out


class Trainer:
    def __init__(self, job: Job, objective=Objective, stop: Optional[StopPolicy] = None):
        self.job, self.cfg, self.rt = job, job.cfg, job.rt
        self.model, self.data, self.engine, self.family, self.dims = (
            job.model,
            job.data,
            job.engine,
            job.family,
            job.dims,
        )
        t = self.cfg.trainer
        # Signals and the time limit, with or without checkpoints (see framework/stop.py).
        self.stop = stop or StopPolicy(max_time_minutes=t.max_time_minutes, rank=self.rt.rank, device=self.rt.device)
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer, job.undecayed, job.hidden, seed=t.seed)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optimizer, t.max_steps)
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.data.train)
        self.ckpt = checkpoints_of(job)
        self.memory = None  # in-memory snapshots (checkpoint.memory_interval): framework/checkpoint/memory.py
        if self.cfg.checkpoint.memory_interval:
            from framework.checkpoint.memory import MemorySnapshots
            from framework.planner.snapshot_fit import planned_snapshots  # their host memory, planned

            self.memory = MemorySnapshots(
                self.cfg, self.rt, self.engine, planned_snapshots(self.cfg, self.rt.world_size)
            )
        self.callbacks = [Snapshots(self.memory, self.ckpt)] if self.memory is not None else []
        if self.ckpt is not None:
            self.callbacks.append(Checkpoints(self.ckpt, resumes=self.memory is None))
        self.tokens_per_step = t.global_batch_size * self.cfg.data.seq_len
        self.peak_tflops = device_peak_tflops(self.rt.device, t.peak_tflops)
        # The step's loss, gradient norm and finite-loss check, on the device between reads
        # ([Note: the host reads the device on log steps only] in framework/metrics.py).
        self.watch = LossWatch(self.rt.device, t.log_interval)
        self.logger = None  # the metrics log, once `fit` starts (step_callbacks.MetricsLog)
        self.objective = objective(self)  # last: a stage's reference model is built after the policy's
        self.deterministic = None  # trainer.deterministic: the same bits at any layout (framework/deterministic.py)
        if t.deterministic:
            from framework.deterministic import DeterministicSteps

            self.deterministic = DeterministicSteps(self)

    def train_step(self, read: bool = True) -> Dict[str, float]:
        """One optimizer step. `read`: the host reads the step's loss and gradient norm (and the
        finite-loss check) before the optimizer step; otherwise nothing waits for the device and
        only the learning rate is returned. See [Note: the host reads the device on log steps only]."""
        if self.deterministic is not None:
            return self.deterministic.train_step(read)
        step, device = self.state.step + 1, self.rt.device
        work = self.objective.work(step)
        out = {"lr": self.scheduler.get_last_lr()[0]}
        for n in range(work.passes):
            draw = iter(work.micro).__next__ if work.micro is not None else None
            next_batch = draw or (lambda: to_device(self.data.train.next_batch(), device))
            total = self.job.runner.forward_backward(next_batch, work.accum, work.loss, device, work.routed)
            self._tail(step, total, out if n == 0 else None, read)
        self.scheduler.step()  # once per trainer step, however many passes
        out.update(self.objective.step_metrics(read))
        return out

    def _tail(self, step: int, total: torch.Tensor, out: Optional[dict], read: bool) -> None:
        """Clip, observe the first pass's loss and gradient norm (the step's), optimizer step, zero_grad."""
        grad_norm = self.engine.clip_grad_norm(self.model, self.cfg.optimizer.clip_grad_norm)
        if out is not None:
            self.watch.observe(step, world_mean(total), grad_norm)  # the global batch's mean loss
            if read:  # raises TrainingDiverged, before the optimizer step, if a loss was not finite
                out["loss"], out["grad_norm"] = self.watch.read(step)
            out.update(self.job.runner.end(read))  # the routers' bias update and statistics
        self.engine.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self) -> Dict[str, float]:
        return self.objective.evaluate()

    def fit(self, started=None) -> int:
        """Train to trainer.max_steps (or a stop); `started()` runs once the job is past its
        refusals (resume, trackers), before the first step: rank 0 records the config there."""
        t, callbacks = self.cfg.trainer, self.callbacks + [MetricsLog(started), Profiler()]
        self.objective.start()  # before any resume
        self.interval = [0.0, 0]  # train_step's seconds and steps since the last record
        try:
            for callback in callbacks:
                callback.start(self)
            self.stop.started = time.monotonic()  # the time limit counts training, not start-up
            shown: dict = {}
            while self.state.step < t.max_steps:
                step = self.state.step + 1
                shown = self._step(step, callbacks, shown)
                if self.stop.should_stop(step) and step < t.max_steps:
                    return self.stop_early(step)
                for callback in reversed(callbacks):
                    callback.end_step(self, step)
            for callback in reversed(callbacks):
                callback.finish(self)
            self._end_of_run()
        finally:
            for callback in reversed(callbacks):
                callback.close()
            self.stop.close()
        return 0

    def _step(self, step: int, callbacks: list, shown: dict) -> dict:
        """One step with its record, evaluation and lm-eval tasks; the progress bar's numbers."""
        t = self.cfg.trainer
        logs = step % t.log_interval == 0 or step == t.max_steps
        evaluates = bool(t.eval_interval) and (step % t.eval_interval == 0 or step == t.max_steps)
        tasks = bool(t.eval_tasks) and (
            step == t.max_steps or bool(t.eval_tasks_interval and step % t.eval_tasks_interval == 0)
        )
        self.engine.reset_counters(self.model)
        tic = time.perf_counter()
        metrics = self.train_step(read=logs or evaluates or tasks or any(c.reads(step) for c in callbacks))
        # on a GPU the steps between reads only queue work, and the read waits for all of it, so
        # the sum of train_step's times is the interval's device time
        self.interval = [self.interval[0] + time.perf_counter() - tic, self.interval[1] + 1]
        for callback in callbacks:
            callback.after_step(self, step)
        self.state.step = step
        if logs:
            step_time, self.interval = self.interval[0] / self.interval[1], [0.0, 0]
            metrics.update(
                throughput(
                    step_time, self.tokens_per_step, self.job.flops_per_token, self.rt.world_size, self.peak_tflops
                )
            )
            metrics["peak_memory_gib"] = peak_memory_gib(self.rt.device)
            metrics.update(self.engine.step_counters(self.model))  # synchronizes on CUDA
            for callback in callbacks:
                metrics.update(callback.metrics())
            shown = {"loss": metrics["loss"], "tok/s": round(metrics["tokens_per_s"]), "step_s": round(step_time, 3)}
        if evaluates:
            metrics.update(self.evaluate())
            self.logger.write(
                f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val_"))
            )
        if tasks:
            from framework.downstream import flat_scores, run_tasks

            metrics.update(flat_scores(run_tasks(self.job, list(t.eval_tasks), step)))
        if logs:
            self.logger.log(step, metrics)
        self.logger.progress(shown)  # as of the last record
        return shown

    def _end_of_run(self) -> None:
        """The task's own showing of the trained model (a text sample, generated examples); every
        rank runs it: the sharded model's forwards are collective."""
        cfg, t = self.cfg, self.cfg.trainer
        if self.objective.end_of_run is None or self.data.tokenizer is None or not self.job.runner.whole_model:
            return
        from framework.generation import generate

        # decoding feeds one token at a time, which sequence parallelism cannot split: no sample
        sampler = None if cfg.parallelism.sequence_parallel and self.dims.tp > 1 else generate
        view = RunView(self.model, self.data, self.rt.device, t.seed, cfg.data.seq_len, t.sample_tokens, full, sampler)
        text = self.objective.end_of_run(view)
        if text and self.rt.is_main:
            self.logger.write(text)

    def describe(self) -> str:
        """The run's first log line: the model, the layout, the batch arithmetic."""
        cfg, t, d, rt = self.cfg, self.cfg.trainer, self.dims, self.rt
        p = cfg.parallelism
        return (
            f"model={cfg.model.name} ({self.job.num_params / 1e6:.1f}M parameters) on {rt.world_size} "
            f"rank(s) of {rt.device.type}: "
            f"{f'pp={d.pp} ({p.pp_schedule.value}) ' if d.pp > 1 else ''}"
            f"dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} "
            f"tp={d.tp}{f' ep={d.ep}' if d.ep > 1 else ''}{f' cp={d.cp}' if d.cp > 1 else ''}, "
            f"engine={p.engine.value}, strategy={p.strategy.value}, "
            f"{self.tokens_per_step} tokens/step ({t.micro_batch_size} micro x {d.dp} dp x "
            f"{self.data.train.accum_steps} accumulation x {cfg.data.seq_len} seq); run dir {cfg.run_dir}"
        )

    def stop_early(self, step: int) -> int:
        """Every rank, after the ranks agreed to stop: save if checkpoints are on, then the requeue status."""
        from framework.errors import EXIT_REQUEUE

        if self.rt.is_main:
            then = (
                "checkpoint, then exit {s} for a requeue; the next start with checkpoint.resume=auto continues from it"
                if self.ckpt is not None
                else "no checkpoint (checkpointing is off), exit {s}"
            ).format(s=EXIT_REQUEUE)
            print(f"stopping at step {step} ({self.stop.reason}): {then}", file=sys.stderr, flush=True)
        if self.ckpt is not None:
            self.watch.read(step, before_optimizer_step=False)  # never save past a non-finite loss
            self.ckpt.save(self.state, blocking=True)
        return EXIT_REQUEUE


def world_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over all ranks, on the device. Tensor-parallel ranks hold the same loss, so this is the
    mean over the data-parallel ranks, without a separate data-parallel group."""
    dist.all_reduce(value)
    return value / dist.get_world_size()


def build_trainer(cfg: Config, rt: Runtime, stage) -> Trainer:
    """A training stage's trainer: its stop policy first (a signal during the build stops the run
    after its first step), the job on the stage's data, then the optimizer and the stage's objective."""
    t = cfg.trainer
    stop = StopPolicy(max_time_minutes=t.max_time_minutes, rank=rt.rank, device=rt.device)
    return Trainer(build_job(cfg, rt, stage.load("data_builder")), stage.load("objective"), stop)


def _train(cfg: Config, rt: Runtime, stage, record=None) -> int:
    """The stage (a framework/stages.py record) on this rank: a training stage's trainer's `fit`, or
    a stage that uses a trained model run on its job (no optimizer), with every failure turned
    into its exit status. `record` (rank 0 calls it): writes the job's config, before training's
    first step or once another stage has finished ([Note: one config.yaml per run] in
    framework/entrypoint.py)."""
    record = record if rt.rank == 0 else None
    try:
        if stage.needs_optimizer:
            return build_trainer(cfg, rt, stage).fit(started=record)
        code = stage.load("body")(build_job(cfg, rt, stage.load("data_builder")))
        if code == 0 and record is not None:
            record()
        return code
    except TrainingDiverged as exc:
        if rt.local_rank == 0:
            print(f"error: {exc}", flush=True)
        return EXIT_DIVERGED
    except UserInputError as exc:
        # Bad input found only once the job runs (a dataset, a checkpoint that does not fit):
        # one line, the bad-input status, as for a refused config. See [Note: bad input vs bugs].
        # Said by the first rank of each node, so every node's log has it (the input a node
        # lacks, its data cache say, may be refused there only); one line per node's log.
        if rt.local_rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001
        # Anything else is a bug or a fault of the machine: its traceback, named by rank. Reported
        # here (not re-raised) so the trainer is gone before the process group (see run()); see
        # [Note: every failure explained] in framework/runtime.py.
        report_crash(exc)
        return EXIT_CRASH


def run(cfg: Config, stage: Any, claim=None, record=None) -> int:
    """One rank's whole job: join the process group, run the stage, leave. Returns the exit status.
    `claim` (under torchrun, where rank 0 is not a parent of the others): rank 0 takes the run
    directory once the ranks can talk, and a refusal there ends every rank with 2. `record`:
    writes the job's config (see `_train`)."""
    forget_crash()
    rt = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
    if claim is not None:
        problem = [claim() if rt.rank == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            if rt.is_main:
                print(f"error: {problem[0]}", file=sys.stderr, flush=True)
            shutdown()
            return EXIT_BAD_INPUT
    code = _train(cfg, rt, stage, record)
    # [Note: nothing outlives the process group]
    # The trainer (model, optimizer, the engine's buffers and pending work) must be gone before the
    # process group is destroyed: an exception's traceback keeps its frames alive, and objects freed
    # only at interpreter exit, after the group, abort the process ("terminate called without an
    # active exception"). Hence _train returns a status, dropping everything, before shutdown.
    gc.collect()
    shutdown()
    return code
