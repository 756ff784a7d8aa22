"""When and where to save, resuming, and the safetensors export/import. (Stopping early on a
signal or the time limit is decided by framework/stop.py; this class only saves.)

The trainer talks to this class only; the on-disk layout is in `layout.py` (see [Note: atomic
checkpoints]) and what else a checkpoint holds in `contents.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from enum import Enum
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from framework.checkpoint import contents, layout
from framework.checkpoint.contents import dcp_load, join_optim, set_rng_state, split_optim, write_rng
from framework.checkpoint.hf import export_safetensors, import_safetensors, read_config
from framework.config.schema import Config
from framework.distributed.engines import engine_of
from framework.distributed.groups import new_group
from framework.errors import EXIT_BAD_INPUT as EXIT_BAD_CHECKPOINT
from framework.errors import (
    EXIT_REQUEUE,  # noqa: F401  (re-exported)
    UserInputError,
)
from framework.fileio import PlantedFileError, directory_link_problem
from framework.peft.lora import adapter_state, is_adapter, merged_sharded_state
from framework.runtime import Runtime

# The stages that train, and so continue a checkpoint of their own stage.
TRAINING_STAGES = ("training", "fine_tuning", "dpo", "grpo")

# The grpo.* settings that make the objective, and the value each had before it was a setting (a
# checkpoint whose manifest lacks one was trained with it): a resume of stage=grpo must keep them.
GRPO_OBJECTIVE = {
    "loss_type": "grpo",
    "beta": 0.04,
    "epsilon": 0.2,
    "epsilon_high": None,
    "scale_rewards": "group",
    "kl_bias_correction": True,
}

# [Note: a checkpoint of another stage]
# A checkpoint records the stage that saved it (its manifest's config.stage). A training stage
# given one saved by another stage (stage=dpo from a pre-training or fine-tuning step directory)
# starts from its weights alone, at step 0, with its own optimizer, LR schedule, data position and
# RNG: that run's position means nothing here. Its checkpoints then record that directory as
# train_state.json's `start`, so a resume of this stage knows the weights it started from (the
# reference of stage=dpo and stage=grpo is exactly those). A checkpoint whose manifest names no
# stage is taken as this job's own and continued. A checkpoint of another stage inside this job's
# checkpoint.dir is refused: the two runs' step directories would mix there (`auto` would pick
# either). checkpoint.init_from (an export) is the other way to start from trained weights.


def _git_revision() -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root, timeout=10).returncode
        return rev + ("-dirty" if dirty else "") if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for package in ("torch", "megatron-core", "tokenizers", "safetensors", "hydra-core", "omegaconf"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


class CheckpointManager:
    def __init__(self, cfg: Config, run_dir: str, rt: Runtime):
        self.cfg, self.rt = cfg, rt
        self.tokenizer = None  # the job's tokenizer (set by the trainer), written next to an export
        c = cfg.checkpoint
        self.root = c.dir if os.path.isabs(c.dir) else os.path.join(run_dir, c.dir)
        self.run_dir = run_dir
        self.engine = cfg.parallelism.engine
        self._sharded = engine_of(self.engine)  # its state dicts (framework/distributed/engines.py)
        self._last_saved = -1
        self._start = False  # start_of_run's answer once known (False: not yet asked)
        self._start_recorded = None  # the start as the resumed checkpoint's train_state.json wrote it
        self._announced = None  # the other stage's checkpoint whose weights were loaded and said so
        self._pending = None  # (future, tmp_dir, step) of an async save not yet committed
        # Async saves run their collectives in a background thread: they get their own gloo group,
        # so they never interleave with the training loop's collectives on the default group.
        self._io_group = new_group(backend="gloo") if c.async_save else None
        token = [os.urandom(4).hex() if rt.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        self._token = token[0]  # names this job's temp directories (the same on every rank)
        # A link there is followed only if it is the user's own (checked before any rank started
        # too); every rank refuses if any rank's file system says so.
        links = [None] * rt.world_size
        dist.all_gather_object(links, directory_link_problem(self.root, f"checkpoint.dir={c.dir}"))
        if any(links):
            raise PlantedFileError(next(p for p in links if p))
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise UserInputError(
                f"checkpoint.dir={c.dir}: {self.root} is a file, not a directory; name a "
                "directory (it is created if missing)"
            )
        self._together(
            lambda: os.makedirs(self.root, exist_ok=True),
            f"checkpoint.dir={c.dir}: cannot create {self.root}",
            "give a writable directory",
        )
        if rt.rank == 0:
            self._git = _git_revision()

    # ---- saving ----

    def should_save(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0

    def save(self, state, blocking: bool = False) -> None:
        """Write a checkpoint of `state` (every rank its shards); asynchronously if
        checkpoint.async_save, unless `blocking` (stopping early). See [Note: atomic checkpoints]."""
        step = state.step
        if step == self._last_saved:
            return
        start = self.start_of_run()  # every rank (it may refuse), before rank 0 writes it
        self._finalize_pending()
        tmp = os.path.join(self.root, f"{layout.step_dir_name(step)}.tmp-{self._token}")
        model_sd, optim_sd = self._sharded.get_state_dicts(state.model, state.optimizer)
        if self.cfg.peft.lora.enabled:  # the adapters only: the frozen base is checkpoint.init_from's
            model_sd = adapter_state(model_sd)
        optim_tensors, groups = split_optim(optim_sd)
        app = {"model": model_sd, "optim": optim_tensors}

        def write_small_files() -> None:
            os.makedirs(tmp, exist_ok=True)
            write_rng(tmp, self.rt.rank)
            if self.rt.is_main:
                layout.write_json_atomic(
                    os.path.join(tmp, layout.TRAIN_STATE),
                    {
                        "step": step,
                        "scheduler": state.scheduler.state_dict(),
                        "train_loader": state.train_loader.state_dict(),
                        "optimizer_param_groups": groups,
                        "start": self._recorded_start(start, step),  # [Note: a checkpoint of another stage]
                    },
                )

        self._writing(write_small_files, tmp)
        if self.cfg.checkpoint.async_save and not blocking:
            # Snapshot CPU tensors first: training goes on mutating them while the thread writes.
            # (DCP's stager copies device tensors to CPU itself; a second copy there would only
            # cost device memory.)
            app = _cpu_snapshot(app)
            future = dcp.async_save(app, checkpoint_id=tmp, process_group=self._io_group)
            self._pending = (future, tmp, step)
        else:
            self._writing(lambda: dcp.save(app, checkpoint_id=tmp), tmp)
            self._commit(tmp, step)
        self._last_saved = step

    # [Note: a failed save]
    # A save that cannot be written (a full file system, a read-only or vanished checkpoint.dir)
    # stops training on every rank with one line naming the path and the cause, and the
    # bad-input status (2): the ranks first agree that some rank failed (one all_gather), the temp
    # directory is removed (no partial files for a later resume to trip over), and the previous
    # checkpoint stays complete and `latest`. Fix the disk, then resume with checkpoint.resume=auto.
    # Training does not go on without checkpoints: a run that cannot save would lose its progress.

    def _together(self, fn, what: str, fix: str) -> None:
        """Run `fn` on every rank; if it fails on any, raise the same CheckpointWriteError on all."""
        error = None
        try:
            fn()
        except (OSError, dcp.CheckpointException, RuntimeError) as exc:
            error = _cause(exc, self.root)
        errors = [None] * self.rt.world_size
        dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            rank, cause = failed[0]
            where = f" (rank {rank})" if self.rt.world_size > 1 else ""
            raise CheckpointWriteError(f"{what}{where}: {cause}; {fix}")

    def _writing(self, fn, tmp: str) -> None:
        """`_together` for a step of a save: on failure the temp directory goes, `latest` stays."""
        try:
            previous = layout.latest_checkpoint(self.root)
        except layout.CheckpointError:
            previous = None
        keep = f"{previous} stays the latest checkpoint" if previous else "no earlier checkpoint exists"
        try:
            self._together(
                fn,
                f"checkpoint.dir: could not write {tmp}",
                f"{keep}; free space or make checkpoint.dir writable, then resume with checkpoint.resume=auto",
            )
        except CheckpointWriteError:
            if self.rt.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _finalize_pending(self) -> None:
        """Wait for the async save in flight (if any) and commit it."""
        if self._pending is None:
            return
        future, tmp, step = self._pending
        self._pending = None
        self._writing(lambda: _wait(future), tmp)
        self._commit(tmp, step)

    def _commit(self, tmp: str, step: int) -> None:
        """Every rank checksums a share of the files; rank 0 writes the manifest and commits."""
        dist.barrier()
        names = [layout.files_of(tmp) if self.rt.is_main else None]
        dist.broadcast_object_list(names, src=0)  # one listing: file systems may lag between nodes
        names = names[0]
        mine = {}

        def checksum_my_share() -> None:
            for name in names[self.rt.rank :: self.rt.world_size]:
                path = os.path.join(tmp, name)
                layout.fsync_file(path)
                mine[name] = {"sha256": layout.sha256_of(path), "bytes": os.path.getsize(path)}

        self._writing(checksum_my_share, tmp)
        shares = [None] * self.rt.world_size
        dist.all_gather_object(shares, mine)
        final = os.path.join(self.root, layout.step_dir_name(step))

        def commit() -> None:
            if self.rt.is_main:
                files = {k: v for share in shares for k, v in share.items()}
                layout.commit(tmp, final, self._manifest(step, files))

        self._writing(commit, tmp)
        if self.rt.is_main:
            layout.prune(self.root, self.cfg.checkpoint.keep_last)
            print(f"saved checkpoint {final}", file=sys.stderr, flush=True)
        dist.barrier()

    def _manifest(self, step: int, files: dict) -> dict:
        from framework.config.validate import parallel_dims_of

        dims = parallel_dims_of(self.cfg, self.rt.world_size)
        p = self.cfg.parallelism
        return {
            "format": layout.FORMAT_VERSION,
            "step": step,
            "complete": True,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "world": {
                "world_size": self.rt.world_size,
                "dp_replicate": dims.dp_replicate,
                "dp_shard": dims.dp_shard,
                "tp": dims.tp,
                "engine": p.engine.value,
                "strategy": p.strategy.value,
                "device": self.rt.device.type,
            },
            "config": dataclasses.asdict(self.cfg),
            "versions": _versions(),
            "git": self._git,
            "files": files,
        }

    # ---- resuming ----

    def _resume_path(self) -> Optional[str]:
        """The step directory checkpoint.resume names (auto: the latest complete one), or None."""
        c = self.cfg.checkpoint
        if c.resume == "auto":
            return layout.latest_checkpoint(self.root)
        if c.resume in ("none", ""):
            return None
        if os.path.isdir(c.resume) and layout.step_of(c.resume) is None:
            path = layout.latest_checkpoint(c.resume)  # a checkpoints directory: its latest
            if path is None:
                self._refuse(
                    f"checkpoint.resume={c.resume}: no complete checkpoint in this directory; "
                    "name a step_* directory, or use 'auto' or 'none'"
                )
            return path
        return c.resume

    def _imported_source(self) -> str:
        from framework.models.registry import family_of

        return self.cfg.checkpoint.init_from or family_of(self.cfg.model).weights_dir(self.cfg.model)

    def _other_stage(self, path: str) -> Optional[str]:
        """The stage that saved `path` when it is not this training job's: see [Note: a checkpoint
        of another stage]."""
        if self.cfg.stage.value not in TRAINING_STAGES:
            return None
        try:
            saved = layout.read_manifest(path).get("config", {}).get("stage")
        except layout.CheckpointError:  # load() names what is wrong with it, and the previous good one
            return None
        if not isinstance(saved, str) or saved == self.cfg.stage.value:
            return None
        root = os.path.abspath(self.root)
        if os.path.commonpath([root, os.path.abspath(path)]) == root:
            self._refuse(
                f"checkpoint.resume: {path} was saved by stage={saved} in this job's checkpoint.dir ({self.root}), "
                f"where stage={self.cfg.stage.value}'s own checkpoints would mix with it: give this stage its own "
                f"run directory (hydra.run.dir) and checkpoint.resume={os.path.abspath(path)} to start from its weights"
            )
        return saved

    def start_of_run(self) -> Optional[str]:
        """The other stage's step directory this run's weights started from (None: the seeded
        initialisation or the import), as this job's checkpoint.resume and, on a resume of this
        stage, its checkpoint's train_state.json say."""
        if self._start is not False:
            return self._start
        try:
            path = self._resume_path()
            if path is None:
                start = None
            elif self._other_stage(path):
                start = os.path.abspath(path)
            else:
                start = contents.read_train_state(path).get("start")  # absent: a start without one
                start = start if isinstance(start, str) and start else None
                if start is not None:  # relative: to the step directory that recorded it
                    self._start_recorded = start
                    start = os.path.normpath(os.path.join(os.path.abspath(path), start))
        except layout.CheckpointError:  # a damaged checkpoint: load() says so, naming the previous good one
            start = None
        except ValueError as exc:
            self._refuse(str(exc))
        self._start = start
        return start

    def _recorded_start(self, start: Optional[str], step: int) -> Optional[str]:
        """`start` as train_state.json records it: relative to the step directory when it lies in
        the directory that holds this run's directory (a sibling stage's run: the two move
        together), absolute otherwise."""
        if start is None:
            return None
        run = os.path.abspath(self.run_dir)
        tree = os.path.dirname(run)
        inside = lambda p, d: os.path.commonpath([d, p]) == d  # noqa: E731
        root = os.path.abspath(self.root)
        if tree == os.path.dirname(tree) or not inside(root, run) or not inside(start, tree):
            return start  # the tree is the filesystem root, or the checkpoints live outside the run
        return os.path.relpath(start, os.path.join(root, layout.step_dir_name(step)))

    def _load_start(self, state, announce: bool = True) -> None:
        """The weights of the other stage's checkpoint this run started from (start_of_run, not
        None); refused in one line, naming the path looked for, when that directory is gone."""
        start = self._start
        if not os.path.isdir(start):
            recorded = self._start_recorded
            said = f"{recorded} (looked for {start})" if recorded and recorded != start else start
            self._refuse(
                f"checkpoint.resume: this run started from the weights of {said}, which is gone; the reference "
                "model (or, with LoRA, the frozen base) is those weights: restore that directory, or start afresh"
            )
        self.load(state, start, weights_only=True, announce=announce)

    def load_starting_weights(self, state) -> None:
        """The weights this run started from into `state.model`, before any resume: the other
        stage's checkpoint (start_of_run), else the import (checkpoint.init_from, model.path), else
        nothing (the seeded initialisation stays). stage=dpo and stage=grpo copy them into their
        reference ([Note: the reference model] in framework/dpo/stage.py)."""
        start = self.start_of_run()
        try:
            if start is None:
                source = self._imported_source()
                if source:
                    self.import_weights(state, source)
                return
            self._load_start(state)
        except (layout.CheckpointError, ValueError) as exc:
            self._refuse(str(exc))

    def resume(self, state) -> int:
        """Restore `state` from the checkpoint checkpoint.resume names (auto: the latest complete
        one); import checkpoint.init_from on a fresh start; only the weights of a checkpoint of
        another stage ([Note: a checkpoint of another stage]). Returns the step to continue from."""
        self.start_of_run()  # kept for this run's saves
        try:
            path = self._resume_path()
            if path is None:
                source = self._imported_source()
                if source:
                    self.import_weights(state, source)
                return 0
            if self._other_stage(path):
                self.load(state, path, weights_only=True)
                return 0
            if self.cfg.peft.lora.enabled:  # the frozen base first; the checkpoint holds the adapters
                if self._start is not None:  # the other stage's checkpoint this run started from
                    self._load_start(state, announce=False)
                    if self.rt.is_main:
                        print(f"the frozen base: the weights of {self._start}", file=sys.stderr, flush=True)
                else:
                    source = self._imported_source()  # checkpoint.init_from, else model.path's weights
                    if source:
                        self.import_weights(state, source)
            return self.load(state, path)
        except (layout.CheckpointError, ValueError) as exc:
            self._refuse(str(exc))

    def _refuse(self, message: str) -> None:
        """Bad checkpoint input: one line on rank 0, the bad-input status on every rank."""
        if self.rt.is_main:
            print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BAD_CHECKPOINT)

    def load(self, state, path: str, weights_only: bool = False, announce: bool = True) -> int:
        """Restore `state` from the step directory `path`; with `weights_only`, the model's weights
        alone (the optimizer, LR schedule, data position and RNG stay this job's fresh ones)."""
        path = os.path.abspath(path)
        try:
            manifest = layout.read_manifest(path)
        except layout.CheckpointError as exc:  # name the previous good checkpoint, as below
            message = layout.integrity_message(path, [str(exc)], find_good=self.rt.is_main)
            raise layout.CheckpointError(message) from None
        expected = manifest["files"]
        mine = sorted(expected)[self.rt.rank :: self.rt.world_size]
        problems = [None] * self.rt.world_size
        dist.all_gather_object(problems, layout.verify_files(path, expected, mine))
        problems = [p for share in problems for p in share] + layout.unlisted_files(path, expected)
        if problems:
            raise layout.CheckpointError(layout.integrity_message(path, problems, find_good=self.rt.is_main))
        # The small files each rank reads are checked on every rank, and the ranks agree, before
        # anything is loaded: a lie in one rank's RNG file is refused by all, in one line.
        if weights_only:
            return self._load_weights(state, path, manifest, announce)
        saved, rng, problem = None, None, None
        try:
            saved = contents.read_train_state(path)
            rng = contents.read_rng(path, self.rt.rank)
            if state.optimizer is not None:
                _check_fits(path, saved, state)
        except layout.CheckpointError as exc:
            problem = str(exc)
        problems = [None] * self.rt.world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
        if problem:
            raise layout.CheckpointError(problem)
        self._check_same_model(path, manifest)
        trains = state.optimizer is not None  # else a stage that uses the trained model: its weights alone
        if trains:
            self._check_same_optimizer(path, manifest)
            self._check_same_objective(path, manifest)
        model_sd, optim_sd = self._state_dicts(state)
        lora = self.cfg.peft.lora.enabled  # LoRA checkpoints hold the adapters; the rest stays as it is
        app = {"model": adapter_state(model_sd) if lora else model_sd}
        if trains:
            app["optim"] = split_optim(optim_sd)[0]
        dcp_load(app, path)
        optim_sd = join_optim(app["optim"], saved["optimizer_param_groups"]) if trains else None
        self._set_state_dicts(state, {**model_sd, **app["model"]}, optim_sd)
        if trains:
            state.scheduler.load_state_dict(saved["scheduler"])
            state.train_loader.load_state_dict(saved["train_loader"])
        set_rng_state(rng)
        self._last_saved = saved["step"]
        if self.rt.is_main:
            w = manifest["world"]
            print(
                f"resumed from {path} at step {saved['step']} (saved by {w['world_size']} ranks, "
                f"engine={w['engine']}; now {self.rt.world_size} ranks, engine={self.engine.value})",
                file=sys.stderr,
                flush=True,
            )
        return int(saved["step"])

    def _load_weights(self, state, path: str, manifest: dict, announce: bool = True) -> int:
        self._check_same_model(path, manifest)
        saved = manifest.get("config", {})
        if saved.get("peft", {}).get("lora", {}).get("enabled"):
            raise layout.CheckpointError(
                f"checkpoint.resume: {path} holds LoRA adapters only (stage={saved.get('stage')}); start from its "
                "merged model instead: its export (checkpoint.export_safetensors=true) as checkpoint.init_from"
            )
        model_sd, optim_sd = self._state_dicts(state)
        adapters = {k: v for k, v in model_sd.items() if is_adapter(k)}  # LoRA's own: not in the file
        app = {"model": {k: v for k, v in model_sd.items() if not is_adapter(k)}}
        dcp_load(app, path)
        self._set_state_dicts(state, {**app["model"], **adapters}, optim_sd)
        if state.optimizer is not None:
            state.optimizer.state.clear()  # a fresh optimizer, as after an import (import_weights)
        # said once (the reference's load, then the resume's); a resume's base load says its own line
        if announce and self.rt.is_main and self._announced != path:
            self._announced = path
            print(
                f"initialised the model from {path} (saved by stage={saved.get('stage')} at step "
                f"{manifest.get('step')}); stage={self.cfg.stage.value} starts at step 0",
                file=sys.stderr,
                flush=True,
            )
        return 0

    def _check_same_objective(self, path: str, manifest: dict) -> None:
        """stage=grpo: refuse a resume whose grpo.* objective differs from the one the checkpoint was
        trained with (the defaults moved to TRL's: a resume would switch objective mid-run)."""
        saved = manifest.get("config", {})
        if self.cfg.stage.value != "grpo" or saved.get("stage") != "grpo":
            return
        given, before = dataclasses.asdict(self.cfg.grpo), saved.get("grpo", {})
        differ = []
        for name, earlier in GRPO_OBJECTIVE.items():
            was = before.get(name, earlier)  # absent: saved before the field existed, with that value
            now = given[name]
            was, now = (v.value if isinstance(v, Enum) else v for v in (was, now))
            if was != now:
                differ.append((f"grpo.{name}={was}", f"{now}"))
        if differ:
            raise layout.CheckpointError(
                f"checkpoint.resume: {path} was trained with {' '.join(d[0] for d in differ)} (this job: "
                f"{', '.join(d[1] for d in differ)}; the defaults are TRL's since beta 0.0, loss_type dapo): set "
                "those to continue its objective, or start afresh"
            )

    def _check_same_optimizer(self, path: str, manifest: dict) -> None:
        """Refuse an optimizer that cannot take the saved state (before any state is touched); say
        in one line which given hyper-parameters the checkpoint's values override."""
        saved = manifest.get("config", {}).get("optimizer", {})
        now = dataclasses.asdict(self.cfg.optimizer)
        name = "name" if "name" in now else None
        if name and name in saved and _plain(saved[name]) != _plain(now[name]):
            raise layout.CheckpointError(
                f"checkpoint.resume: {path} was saved with optimizer.{name}={_plain(saved[name])}; its state "
                f"does not fit optimizer.{name}={_plain(now[name])}: resume with optimizer={_plain(saved[name])}, "
                "or start afresh from its weights with checkpoint.resume=none and checkpoint.init_from"
            )
        # The state's dtype is the one it was saved in ([Note: bf16 optimizer state and its rounding]
        # in framework/optim/lowp.py; checkpoints from before the setting held float32 state).
        saved_dtype, dtype = _plain(saved.get("state_dtype", "fp32")), _plain(now.get("state_dtype", "fp32"))
        if saved and saved_dtype != dtype:
            raise layout.CheckpointError(
                f"checkpoint.resume: {path} was saved with optimizer.state_dtype={saved_dtype}; resume with "
                f"optimizer.state_dtype={saved_dtype}, or start afresh from its weights with "
                "checkpoint.resume=none and checkpoint.init_from"
            )
        # The optimizer's param groups (lr, betas, weight decay, ...) and the LR schedule's state
        # come from the checkpoint, so these values given now do not take effect.
        keys = ("lr", "weight_decay", "beta1", "beta2", "eps")
        if _plain(now.get(name)) == "sgd":
            keys += ("momentum",)
        overridden = [
            f"optimizer.{k}={_plain(now[k])} (the checkpoint's {_plain(saved[k])} is used)"
            for k in keys
            if k in saved and k in now and _plain(saved[k]) != _plain(now[k])
        ]
        if overridden and self.rt.is_main:
            print(
                f"warning: resuming from {path}: {'; '.join(overridden)}: the optimizer state and LR schedule "
                "continue as saved; to change them, start from the weights with checkpoint.init_from",
                file=sys.stderr,
                flush=True,
            )

    def _check_same_model(self, path: str, manifest: dict) -> None:
        saved = manifest.get("config", {}).get("model", {})
        # the family's arguments (older checkpoints kept them beside name, newer under args)
        saved_args = {**{k: v for k, v in saved.items() if k != "args"}, **(saved.get("args") or {})}
        now = dict(self.cfg.model.args or {})
        keys = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings")
        differ = [
            f"model.args.{k}={saved_args[k]} there, {now[k]} here"
            for k in keys
            if k in saved_args and k in now and saved_args[k] != now[k]
        ]
        if differ:
            raise layout.CheckpointError(
                f"checkpoint.resume: {path} holds another model ({'; '.join(differ)}); resume it with "
                f"model={saved.get('name', '?')} and its settings, or start this model with checkpoint.resume=none"
            )

    # ---- Hugging Face export / import ----

    def _adapter(self, model_sd: dict, where: str):
        """(model config with the built vocabulary size, the family's state-dict adapter)."""
        from framework.errors import UserInputError
        from framework.models.registry import family_of

        family = family_of(self.cfg.model)
        model_cfg = family.with_vocab_size(self.cfg.model, _vocab_of(model_sd, self.cfg, family))
        if family.adapter is None:
            raise UserInputError(
                f"{where}: model={self.cfg.model.name} has no Hugging Face adapter; turn this option off for it"
            )
        return model_cfg, family.adapter(model_cfg)

    def export(self, state, out_dir: Optional[str] = None) -> Optional[str]:
        """model.safetensors + config.json under `<checkpoint.dir>/export` (every rank calls it)."""
        out_dir = out_dir or os.path.join(self.root, "export")
        model_sd, _ = self._state_dicts(state)
        if self.cfg.peft.lora.enabled:  # a plain model: the adapters folded into their weights
            lora = self.cfg.peft.lora
            model_sd = merged_sharded_state(model_sd, lora.alpha / lora.rank)
        gather = None
        if self.cfg.parallelism.pp > 1:  # each rank holds its stages' tensors: [Note: a pipeline's export]
            model_sd, gather = _pipeline_export(model_sd, self.rt.device)
        model_cfg, adapter = self._adapter(model_sd, "checkpoint.export_safetensors")
        dtype = next(t.dtype for t in model_sd.values() if isinstance(t, torch.Tensor) and t.is_floating_point())
        config = adapter.hf_config(model_cfg, dtype)
        path = export_safetensors(model_sd, adapter, config, out_dir, self.rt.rank, gather=gather)
        if path and hasattr(adapter, "write_extras"):
            adapter.write_extras(out_dir, self.tokenizer, model_cfg)
        dist.barrier()
        if path:
            print(f"exported {path}", file=sys.stderr, flush=True)
        return path

    def import_weights(self, state, directory: str) -> None:
        model_sd, optim_sd = self._state_dicts(state)
        adapters = {k: v for k, v in model_sd.items() if is_adapter(k)}  # LoRA's, not in the file
        model_sd = {k: v for k, v in model_sd.items() if not is_adapter(k)}
        where = (
            f"checkpoint.init_from={directory}"
            if directory == self.cfg.checkpoint.init_from
            else f"model.path={directory}"
        )
        model_cfg, adapter = self._adapter(model_sd, where)
        hf_config = read_config(directory) if os.path.isdir(directory) else None
        if hf_config is not None:
            adapter.check_hf_config(hf_config, model_cfg, where)
        # parallelism.pp: each rank reads its stages' tensors; every tensor is used by some rank
        elsewhere = _used_by_any_rank if self.cfg.parallelism.pp > 1 else None
        loaded, count = import_safetensors(directory, model_sd, adapter, where, elsewhere)
        self._set_state_dicts(state, {**loaded, **adapters}, optim_sd)
        # Getting the state dicts made optimizer state (a zero-lr step, so a load has a template);
        # imported weights start training as in a plain loop: no moments, step counter 0 (a
        # counter of 1 would change AdamW's bias correction from the first step).
        if state.optimizer is not None:
            state.optimizer.state.clear()
        if self.rt.is_main:
            print(f"initialised {count} tensors from {directory}", file=sys.stderr, flush=True)

    def _state_dicts(self, state):
        """(model_sd, optim_sd) of `state`; a stage that trains nothing has no optimizer: (model_sd, None)."""
        if state.optimizer is None:
            return self._sharded.get_model_state_dict(state.model), None
        return self._sharded.get_state_dicts(state.model, state.optimizer)

    def _set_state_dicts(self, state, model_sd, optim_sd) -> None:
        if state.optimizer is None:
            self._sharded.set_model_state_dict(state.model, model_sd)
        else:
            self._sharded.set_state_dicts(state.model, state.optimizer, model_sd, optim_sd)

    # ---- the end ----

    def finish(self, state) -> None:
        c = self.cfg.checkpoint
        if c.save_final:
            self.save(state)
        self._finalize_pending()
        if c.export_safetensors:
            self.export(state)

    def close(self) -> None:
        """An async save still in flight here means training failed before finish(): let its
        thread end, but do not commit it (its temp dir is pruned later)."""
        if self._pending is not None:
            future = self._pending[0]
            try:
                _wait(future)
            except Exception:  # noqa: BLE001 - the run is already failing; keep its first error
                pass
            self._pending = None


class CheckpointWriteError(UserInputError):
    """A checkpoint could not be written (see [Note: a failed save])."""


def _cause(exc: BaseException, where: str) -> str:
    """One line: the OS error and its file, from an OSError or from DCP's collected failures. A
    write that torch's serializer reports only as an internal assertion ("enforce fail ...
    file write failed") is named as a failed write, with the file system's state when it is full."""
    if isinstance(exc, dcp.CheckpointException):
        failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        exc = next((f for f in failures if isinstance(f, OSError)), failures[0] if failures else exc)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")
    text = str(exc).strip().splitlines()
    if isinstance(exc, RuntimeError) and ("write failed" in str(exc) or "enforce fail" in str(exc)):
        try:
            fs = os.statvfs(where)
            free = fs.f_bavail * fs.f_frsize
        except OSError:
            free = None
        if free is not None and free < 1 << 20:
            return f"No space left on device (writing under {where}: {free} bytes free)"
        return f"a write under {where} failed"
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _plain(value):
    """A config value as the manifest's JSON holds it (enums by value, tuples as lists)."""
    value = getattr(value, "value", value)
    return list(value) if isinstance(value, tuple) else value


def _wait(future) -> None:
    """dcp.async_save returns a Future, or an AsyncSaveResponse with an upload future."""
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()


def _vocab_of(model_sd: dict, cfg: Config, family) -> int:
    """The vocabulary size the model was built with (the data's tokenizer may have decided it)."""
    emb = model_sd.get(family.embedding_name) if family.embedding_name else None
    return int(emb.shape[0]) if emb is not None else family.vocab_size(cfg.model)


def _check_fits(path: str, saved: dict, state) -> None:
    """The saved LR-schedule state and optimizer param groups have the fields, and kinds of value,
    of this job's (a crafted train_state.json would otherwise set arbitrary attributes)."""

    def kinds_match(mine, theirs) -> bool:
        number = (int, float)
        if isinstance(mine, bool) or isinstance(theirs, bool):
            return type(mine) is type(theirs) or mine is None
        if isinstance(mine, number):
            return isinstance(theirs, number)
        if isinstance(mine, (list, tuple)):
            return isinstance(theirs, (list, tuple)) and len(mine) == len(theirs)
        return mine is None or theirs is None or isinstance(theirs, type(mine))

    where = f"{path}/{layout.TRAIN_STATE}"
    live = state.scheduler.state_dict()
    mine_keys = {k for k, v in live.items() if not callable(v)}
    theirs = saved["scheduler"]
    if set(theirs) - set(live) or any(not kinds_match(live[k], theirs[k]) for k in mine_keys & set(theirs)):
        raise layout.CheckpointError(
            f"{where}: 'scheduler' does not hold this job's LR-schedule state; resume from another checkpoint"
        )
    groups, live_groups = saved["optimizer_param_groups"], state.optimizer.param_groups
    if len(groups) != len(live_groups) or any(
        k not in g or not kinds_match(lg[k], g[k]) for g, lg in zip(groups, live_groups) for k in lg if k != "params"
    ):
        raise layout.CheckpointError(
            f"{where}: 'optimizer_param_groups' does not match this job's optimizer ({len(live_groups)} groups); "
            "resume from another checkpoint"
        )


def _cpu_snapshot(tree):
    if isinstance(tree, dict):
        return {k: _cpu_snapshot(v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and tree.device.type == "cpu":
        return tree.detach().clone()
    return tree


# [Note: a pipeline's export]
# Under parallelism.pp each rank's state dict holds its own stages' tensors only (sharded over the
# stage's data- and tensor-parallel ranks). Every rank learns every tensor's name, shape and dtype
# and the lowest rank holding it (one all_gather_object of the names, no data), and completes its
# state dict with empty meta tensors for the others', so every rank walks the same files and
# tensors in the same order. For each tensor in turn, its holders gather it whole (their stage's
# collective), and the lowest holder sends it to rank 0 unless rank 0 holds it itself: rank 0
# writes it and frees it before the next. No rank ever holds more than one whole tensor beside
# its own shards, as in the export without a pipeline ([Note: streamed export] in hf.py).


def _pipeline_export(model_sd: dict, device) -> tuple:
    """(every rank's tensors by name, this rank's own or a meta placeholder; gather(name, tensor)
    giving the whole tensor on rank 0): see [Note: a pipeline's export]."""
    mine = {
        k: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        for k, t in model_sd.items()
        if isinstance(t, torch.Tensor)
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    holder: dict = {}
    complete: dict = {}
    for rank, tensors in enumerate(gathered):
        for name, (shape, dtype) in tensors.items():
            if name not in holder:
                holder[name] = rank
                complete[name] = model_sd.get(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
    me = dist.get_rank()

    def gather(name: str, t: torch.Tensor) -> torch.Tensor:
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t  # the holders' collective
        src = holder[name]
        if src == 0:
            return whole
        if me == src:
            dist.send(whole.detach().contiguous(), dst=0)
        elif me == 0:
            whole = torch.empty(t.shape, dtype=t.dtype, device=device)
            dist.recv(whole, src=src)
        return whole

    return complete, gather


def _used_by_any_rank(keys: set) -> set:
    """The union of every rank's `keys` (a collective): what a pipeline's stages use together."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return set().union(*map(set, gathered))
