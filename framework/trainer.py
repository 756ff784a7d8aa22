"""The training loop: build everything from the config, then step. Short; delegates the rest."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from typing import Dict

import torch
import torch.distributed as dist

from framework.config.schema import Config, Stage
from framework.config.validate import parallel_dims_of
from framework.data import build_data
from framework.distributed.engines import engine_of
from framework.distributed.parallel_dims import build_mesh
from framework.distributed.parallelize import parallelize
from framework.distributed.tensor_parallel import full, loss_context
from framework.errors import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_DIVERGED, UserInputError
from framework.metrics import (
    LossWatch,
    MetricsLogger,
    TrainingDiverged,
    device_peak_tflops,
    peak_memory_gib,
    throughput,
)
from framework.models import family_of
from framework.models.tasks import IGNORE_INDEX, RunView, to_device
from framework.optim import build_optimizer, build_scheduler, hidden_matrix_names, no_decay_names
from framework.profiling import StepProfiler
from framework.routing import RouterSteps
from framework.runtime import Runtime, init_distributed, report_crash, shutdown
from framework.stop import StopPolicy
from framework.train_state import TrainState


class Trainer:
    # (cfg, dp_rank=, dp_size=) -> DataBundle: a stage's own data, in a subclass (None: the data section's)
    data_builder = None

    def __init__(self, cfg: Config, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        t = cfg.trainer
        # Signals and the time limit, with or without checkpoints (see framework/stop.py).
        self.stop = StopPolicy(max_time_minutes=t.max_time_minutes, rank=rt.rank, device=rt.device)
        self.dims = parallel_dims_of(cfg, rt.world_size)
        cfg.trainer.fit_micro_batch(self.dims.dp)  # null: chosen for this world (validation did it too)
        self.mesh = build_mesh(self.dims, rt.device.type)
        # This rank's position among the data-parallel ranks (replicate-major, as the mesh is laid out).
        self.dp_rank = self.mesh.get_local_rank("dp_replicate") * self.dims.dp_shard + self.mesh.get_local_rank(
            "dp_shard"
        )
        torch.manual_seed(t.seed)

        # The model family (framework/models/registry.py) and its task: how a batch becomes a loss.
        self.family = family = family_of(cfg.model)
        self.task = family.task(cfg.model)
        if self.dims.cp > 1 and self.task.summed_loss is None:
            raise UserInputError(
                f"parallelism.cp={self.dims.cp} with model.task={self.task.name}: only causal language "
                "modelling splits its sequences; set parallelism.cp=1"
            )
        if self.data_builder is not None:  # a stage's own data (a subclass's: framework/dpo/trainer.py)
            self.data = self.data_builder(cfg, dp_rank=self.dp_rank, dp_size=self.dims.dp)
        elif cfg.stage == Stage.fine_tuning:  # JSONL records, response-only labels (framework/finetune/)
            from framework.finetune.build import build_finetune_data

            self.data = build_finetune_data(cfg, dp_rank=self.dp_rank, dp_size=self.dims.dp)
        else:
            self.data = build_data(
                cfg.data,
                vocab_size=family.vocab_size(cfg.model),
                micro_batch_size=t.micro_batch_size,
                global_batch_size=t.global_batch_size,
                dp_rank=self.dp_rank,
                dp_size=self.dims.dp,
                seed=t.seed,
                sample_kind=self.task.sample_kind,
                num_labels=family.num_labels(cfg.model),
                model_path=cfg.model.path,
            )
        model_cfg = family.with_vocab_size(cfg.model, self.data.vocab_size)
        # Small models are materialised identically on every rank (same seed, then sharded), so a
        # run's numbers do not depend on its layout; large ones are built on the meta device and
        # initialised shard by shard after sharding, never whole on one rank.
        self.num_params = family.num_params(family.build(model_cfg, "meta"))
        meta = (
            cfg.model.meta_init if cfg.model.meta_init is not None else 4 * self.num_params > 4 * 2**30
        )  # fp32 bytes of the whole model
        model = family.build(model_cfg, "meta" if meta else "cpu")
        if not meta:
            family.init_weights(model, t.seed)
        if cfg.peft.lora.enabled:  # frozen base, trained adapters (framework/peft/)
            from framework.peft.setup import add_lora

            add_lora(model, cfg.peft.lora, family, model_cfg, seed=t.seed, rank0=rt.is_main)
        self.engine = engine_of(cfg.parallelism.engine)  # clipping, counters (framework/distributed/engines.py)
        undecayed = no_decay_names(model)  # from the model as built: [Note: what weight decay leaves alone]
        hidden = hidden_matrix_names(model)  # Muon's matrices, likewise: [Note: Muon on sharded matrices]
        self.pipeline = None
        if self.dims.pp > 1:  # stages under torch's schedules (framework/distributed/pipeline.py)
            from framework.distributed.pipeline import Pipeline
            from framework.models.tasks import cross_entropy

            accum = self.data.train.accum_steps
            self.pipeline = Pipeline(
                model, self.dims, self.mesh, cfg, family, rt.device, accum, self.task, cross_entropy
            )
            self.model = self.pipeline.model
            kept = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}  # this rank's stages'
            undecayed, hidden = undecayed & kept, hidden & kept
        else:
            self.model = parallelize(model, self.dims, self.mesh, cfg.parallelism, family)
        if meta:
            if self.pipeline is None:  # a pipeline materialised its stages itself
                self.model.to_empty(device=rt.device)
            torch.manual_seed(t.seed + rt.rank)  # each rank draws its own shards' values
            # a pipeline: the whole model's init, which reaches this rank's stages (the rest stays meta)
            family.init_weights(self.model if self.pipeline is None else model, None)
            if cfg.peft.lora.enabled:
                from framework.peft import reset_lora

                reset_lora(self.model)
            torch.manual_seed(t.seed)
        elif rt.device.type != "cpu":
            self.model.to(rt.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, undecayed, hidden, seed=t.seed)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, t.max_steps)
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.data.train)
        self.ckpt = None
        c = cfg.checkpoint
        if (
            c.save_final
            or c.interval
            or c.resume != "none"
            or c.init_from
            or c.export_safetensors
            or family.weights_dir(cfg.model)
        ):
            from framework.checkpoint import CheckpointManager

            self.ckpt = CheckpointManager(cfg, cfg.run_dir, rt)
            self.ckpt.tokenizer = self.data.tokenizer
        self.memory = None  # in-memory snapshots (checkpoint.memory_interval): framework/checkpoint/memory.py
        if c.memory_interval:
            from framework.checkpoint.memory import MemorySnapshots
            from framework.planner.snapshot_fit import planned_snapshots  # their host memory, planned

            self.memory = MemorySnapshots(cfg, rt, self.engine, planned_snapshots(cfg, rt.world_size))
        # A mixture-of-experts model's routers, around each step (framework/routing.py); a pipeline
        # computes no load-balancing loss and keeps none
        self.routers = RouterSteps.of(self.model) if self.pipeline is None else None
        self.flops_per_token = family.flops_per_token(model, cfg.data.seq_len)
        self.peak_tflops = device_peak_tflops(rt.device, t.peak_tflops)
        # The step's loss, gradient norm and finite-loss check, on the device between reads
        # ([Note: the host reads the device on log steps only] in framework/metrics.py).
        self.watch = LossWatch(rt.device, t.log_interval)
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
        model = self.model
        accum = self.data.train.accum_steps
        total = torch.zeros((), device=self.rt.device)
        if self.pipeline is not None:  # every microbatch through the stages: one schedule step
            batches = [to_device(self.data.train.next_batch(), self.rt.device) for _ in range(accum)]
            total, accum = self.pipeline.train_batches(batches), 0
        ahead = []  # the step's micro-batches, when the routers route them first
        if self.routers is not None:  # [Note: global-batch load balancing] in framework/routing.py
            if self.routers.routes_ahead:
                ahead = [to_device(self.data.train.next_batch(), self.rt.device) for _ in range(accum)]
            with loss_context(model), self._sequences_split():
                self.routers.begin(ahead, self._loss)
        for micro in range(accum):
            model.set_requires_gradient_sync(micro == accum - 1)
            batch = ahead[micro] if ahead else to_device(self.data.train.next_batch(), self.rt.device)
            with loss_context(model), self._sequences_split():  # tensor / context parallel
                loss = self._loss(batch) / accum
                loss.backward()
            total += full(loss.detach())
        grad_norm = self.engine.clip_grad_norm(model, self.cfg.optimizer.clip_grad_norm)
        step = self.state.step + 1
        self.watch.observe(step, _world_mean(total), grad_norm)  # the global batch's mean loss
        out = {"lr": self.scheduler.get_last_lr()[0]}
        if read:  # raises TrainingDiverged, before the optimizer step, if a loss was not finite
            out["loss"], out["grad_norm"] = self.watch.read(step)
        if self.routers is not None:  # the aux-loss-free bias update; the router statistics
            out.update(self.routers.end(read))
        self.engine.optimizer_step(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def _loss(self, batch) -> torch.Tensor:
        """The task's loss; under context parallelism this rank's share of it, from its chunk of
        every row (see [Note: context parallelism by all-to-all])."""
        cp = self.dims.cp
        if cp == 1:
            return self.task.loss(self.model, batch)
        from framework.distributed.context_parallel import split_batch

        part, labelled = split_batch(batch, self.mesh.get_local_rank("cp"), cp, IGNORE_INDEX)
        return self.task.summed_loss(self.model, part) * cp / labelled.clamp(min=1)

    def _sequences_split(self):
        if self.dims.cp == 1:
            return contextlib.nullcontext()
        from framework.distributed.context_parallel import active

        return active(self.model)

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """`val_loss`: the mean loss over the same validation samples every time (`eval_iters`
        global batches from the start of the validation set, split over the data-parallel ranks
        like training); and the task's own numbers (`val_<name>`: accuracy, ...) over those
        batches, or the whole split when its loader can give it (`whole_split`)."""
        self.model.eval()
        valid = self.data.valid
        valid.load_state_dict({"consumed_samples": 0})
        batches = [valid.next_batch() for _ in range(self.cfg.trainer.eval_iters * valid.accum_steps)]
        total = torch.zeros((), device=self.rt.device)
        if self.pipeline is not None:  # forward-only passes of the schedule, a step's batches each
            total = self.pipeline.eval_total([to_device(b, self.rt.device) for b in batches], valid.accum_steps)
            batches = []
        for batch in batches:
            with loss_context(self.model), self._sequences_split():  # tensor / context parallel
                total += full(self._loss(to_device(batch, self.rt.device)))
        out = {"val_loss": float(_world_mean(total)) / (self.cfg.trainer.eval_iters * valid.accum_steps)}
        if self.task.metrics is not None and self.pipeline is None:
            if hasattr(valid, "whole_split"):
                batches = valid.whole_split()
            sums: dict[str, torch.Tensor] = {}
            for batch in batches:
                for name, (value, count) in self.task.metrics(self.model, to_device(batch, self.rt.device)).items():
                    pair = torch.stack([full(value).float(), count.float()])
                    sums[name] = sums[name] + pair if name in sums else pair
            for name, pair in sorted(sums.items()):
                dist.all_reduce(pair)  # tensor-parallel ranks would count twice: same ratio
                out[f"val_{name}"] = float(pair[0] / pair[1].clamp(min=1))
        self.model.train()
        return out

    def fit(self, started=None) -> int:
        """Train to trainer.max_steps (or a stop); `started()` runs once the job is past its
        refusals (resume, trackers), before the first step: rank 0 records the config there."""
        cfg, t, rt = self.cfg, self.cfg.trainer, self.rt
        if self.memory is not None:  # the newest snapshot every rank has, else the disk
            self.state.step = self.memory.restore(self.state, self.ckpt)
        elif self.ckpt is not None:
            self.state.step = self.ckpt.resume(self.state)
        tokens_per_step = t.global_batch_size * cfg.data.seq_len
        trackers = self.open_trackers()
        if started is not None:
            try:
                started()
            except BaseException:
                if trackers is not None:
                    trackers.close()
                raise
        logger = MetricsLogger(
            cfg.run_dir,
            enabled=rt.is_main,
            total_steps=t.max_steps,
            start_step=self.state.step,
            jsonl=cfg.logging.jsonl,
            progress_bar=t.progress_bar,
            log_interval=t.log_interval,
            trackers=trackers,
            loss_plot=cfg.logging.loss_plot,
            tokens_per_step=tokens_per_step,
        )
        d = self.dims
        logger.write(
            f"model={cfg.model.name} ({self.num_params / 1e6:.1f}M parameters) on {rt.world_size} "
            f"rank(s) of {rt.device.type}: "
            f"{f'pp={d.pp} ({cfg.parallelism.pp_schedule.value}) ' if d.pp > 1 else ''}"
            f"dp_replicate={d.dp_replicate} dp_shard={d.dp_shard} "
            f"tp={d.tp}{f' ep={d.ep}' if d.ep > 1 else ''}{f' cp={d.cp}' if d.cp > 1 else ''}, "
            f"engine={cfg.parallelism.engine.value}, "
            f"strategy={cfg.parallelism.strategy.value}, "
            f"{tokens_per_step} tokens/step ({t.micro_batch_size} micro x {d.dp} dp x "
            f"{self.data.train.accum_steps} accumulation x {cfg.data.seq_len} seq); run dir {cfg.run_dir}"
        )
        if self.state.step:
            logger.write(f"resumed at step {self.state.step}")
        self.stop.started = time.monotonic()  # the time limit counts training, not start-up
        profiler = StepProfiler(
            t.profile, cfg.run_dir, rt.rank, rt.device, t.profile_wait, t.profile_warmup, t.profile_active
        )
        # train_step's time since the last record: on a GPU the steps between reads only queue
        # work, and the read waits for all of it, so their sum is the interval's device time.
        interval_s, interval_steps, shown = 0.0, 0, {}
        try:
            while self.state.step < t.max_steps:
                step = self.state.step + 1
                logs = step % t.log_interval == 0 or step == t.max_steps
                evaluates = bool(t.eval_interval) and (step % t.eval_interval == 0 or step == t.max_steps)
                tasks = bool(t.eval_tasks) and (
                    step == t.max_steps or bool(t.eval_tasks_interval and step % t.eval_tasks_interval == 0)
                )
                saves = self.ckpt is not None and self.ckpt.should_save(step)
                self.engine.reset_counters(self.model)
                tic = time.perf_counter()
                metrics = self.train_step(read=logs or evaluates or tasks or saves)
                interval_s += time.perf_counter() - tic
                interval_steps += 1
                profiler.step()
                self.state.step = step
                if logs:
                    step_time, interval_s, interval_steps = interval_s / interval_steps, 0.0, 0
                    metrics.update(
                        throughput(step_time, tokens_per_step, self.flops_per_token, rt.world_size, self.peak_tflops)
                    )
                    metrics["peak_memory_gib"] = peak_memory_gib(rt.device)
                    metrics.update(self.engine.step_counters(self.model))  # synchronizes on CUDA
                    if self.memory is not None:  # the snapshots' cost, the restore's source and time
                        metrics.update(self.memory.metrics())
                    shown = {
                        "loss": metrics["loss"],
                        "tok/s": round(metrics["tokens_per_s"]),
                        "step_s": round(step_time, 3),
                    }
                if evaluates:
                    metrics.update(self.evaluate())
                    logger.write(
                        f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith("val_"))
                    )
                if tasks:
                    from framework.downstream import flat_scores, run_tasks

                    metrics.update(flat_scores(run_tasks(self, list(t.eval_tasks), step)))
                if logs:
                    logger.log(step, metrics)
                logger.progress(shown)  # as of the last record
                if self.stop.should_stop(step) and step < t.max_steps:
                    return self.stop_early(step)
                if self.ckpt is not None and self.ckpt.should_save(step):
                    self.ckpt.save(self.state)
                    logger.plot()
                if self.memory is not None:
                    self.memory.snapshot(self.state)
            if self.ckpt is not None:
                self.ckpt.finish(self.state)
            if self.memory is not None:
                self.memory.close(finished=True)
            if self.task.end_of_run is not None and self.data.tokenizer is not None and self.pipeline is None:
                # the task's own showing of the trained model (a text sample, generated examples);
                # every rank runs it: the sharded model's forwards are collective
                from framework.generation import generate

                # decoding feeds one token at a time, which sequence parallelism cannot split: no sample
                sampler = None if cfg.parallelism.sequence_parallel and self.dims.tp > 1 else generate
                view = RunView(
                    self.model, self.data, rt.device, t.seed, cfg.data.seq_len, t.sample_tokens, full, sampler
                )
                text = self.task.end_of_run(view)
                if text and rt.is_main:
                    logger.write(text)
        finally:
            profiler.close()
            logger.plot()  # the end of the run, or as far as it got
            logger.close()
            if self.ckpt is not None:
                self.ckpt.close()
            if self.memory is not None:
                self.memory.wait()
            self.stop.close()
        return 0

    def load_weights(self, stage: str) -> int:
        """Every rank, for a stage that uses a trained model (generate, evaluate): load
        checkpoint.resume or the imported weights; the checkpoint's step (0 for an import)."""
        cfg, c = self.cfg, self.cfg.checkpoint
        imported = c.init_from or self.family.weights_dir(cfg.model)
        if self.ckpt is None or (c.resume in ("none", "") and not imported):
            raise UserInputError(
                f"stage={stage} needs weights: checkpoint.resume=<a step_N directory or auto> or "
                "checkpoint.init_from=<an export directory> (or model.path with weights)"
            )
        return self.ckpt.resume(self.state)

    def open_trackers(self):
        """Rank 0's trackers (framework/trackers.py); the ranks agree on whether they started, so a
        tracker that cannot start ends every rank with one line and status 2 before the first step."""
        cfg = self.cfg
        if not (cfg.logging.tensorboard or cfg.logging.wandb.enabled or cfg.logging.mlflow.enabled):
            return None
        trackers, problem = None, None
        if self.rt.is_main:
            from omegaconf import OmegaConf

            from framework.trackers import open_trackers

            config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True)
            try:
                trackers = open_trackers(cfg.logging, cfg.run_dir, config, resumed=self.state.step > 0)
            except UserInputError as exc:
                problem = str(exc)
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise UserInputError(verdict[0])
        return trackers

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


def _world_mean(value: torch.Tensor) -> torch.Tensor:
    """Mean over all ranks, on the device. Tensor-parallel ranks hold the same loss, so this is the
    mean over the data-parallel ranks, without a separate data-parallel group."""
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _train(cfg: Config, rt: Runtime, body=None, record=None, trainer_class=None) -> int:
    """`trainer_class(cfg, rt).fit()` (a subclass: stage=dpo's), or `body(trainer)` (another stage on the same
    build: generate),
    with every failure turned into its exit status. `record` (rank 0 calls it): writes the job's
    config, before training's first step or once another stage has finished ([Note: one
    config.yaml per run] in framework/entrypoint.py)."""
    record = record if rt.rank == 0 else None
    try:
        if body is None:
            return (trainer_class or Trainer)(cfg, rt).fit(started=record)
        code = body(Trainer(cfg, rt))
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


def run(cfg: Config, claim=None, body=None, record=None, trainer_class=None) -> int:
    """One rank's whole job: join the process group, train (or `body(trainer)`), leave. Returns
    the exit status. `claim` (under torchrun, where rank 0 is not a parent of the others): rank 0
    takes the run directory once the ranks can talk, and a refusal there ends every rank with 2.
    `record`: writes the job's config (see `_train`)."""
    rt = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
    if claim is not None:
        problem = [claim() if rt.rank == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            if rt.is_main:
                print(f"error: {problem[0]}", file=sys.stderr, flush=True)
            shutdown()
            return EXIT_BAD_INPUT
    code = _train(cfg, rt, body, record, trainer_class)
    # [Note: nothing outlives the process group]
    # The trainer (model, optimizer, the engine's buffers and pending work) must be gone before the
    # process group is destroyed: an exception's traceback keeps its frames alive, and objects freed
    # only at interpreter exit, after the group, abort the process ("terminate called without an
    # active exception"). Hence _train returns a status, dropping everything, before shutdown.
    gc.collect()
    shutdown()
    return code
