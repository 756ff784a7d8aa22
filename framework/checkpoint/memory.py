"""In-memory snapshots (checkpoint.memory_interval): what a resume needs, kept in host memory that
outlives the rank process, and the restore a restarted job takes from them before any disk.

Every `memory_interval` steps each rank copies its model and optimizer shards (as the engine's
state dicts give them, the checkpoint's format), the data position, the RNG and the LR schedule
into host buffers, and a thread writes them to one segment in checkpoint.memory_dir (/dev/shm by
default) while training goes on; see [Note: snapshot segments outlive the rank, not the job] in
shm_names.py for names, ownership and sweeping, and [Note: a snapshot counts once committed] here.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from framework.checkpoint import shm_names
from framework.checkpoint.contents import join_optim, rng_state, set_rng_state, split_optim
from framework.errors import UserInputError

FORMAT = 1
DEFAULT_DIR = "/dev/shm"
_MANIFEST_LIMIT = 64 << 20  # bytes: a manifest is the tensors' index and a few KB of state

# [Note: a snapshot counts once committed]
# A rank's snapshot of step N is two files: `<name>.data` (every tensor's bytes, back to back) and
# `<name>.json` (the index of those bytes, the train state, the RNG states and the data file's
# sha256). The data file is created with O_EXCL | O_NOFOLLOW, mode 0600, and written whole; the
# manifest is written to `<name>.json.tmp` and renamed over `<name>.json`, last: a snapshot with
# no manifest was torn (the rank died while writing it) and does not exist for a restore. Before a
# rank writes step N it waits for its previous write and the ranks agree that every one of those
# writes succeeded (one all_gather): so every rank has committed step N - interval before any rank
# removes older generations, and a rank keeps at most two (the newest committed and the one being
# written). A restore takes the newest step every rank has committed, checks each data file
# against its manifest's hash, and uses it only if every rank's is whole; otherwise the disk.


class SnapshotRefused(Exception):
    """A segment that is not whole, not ours, or not of this job's layout."""


def _job_of(run_dir: str) -> str:
    return hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:12]


def _creator_pid() -> int:
    """The process that outlives this rank: the torchrun agent or `main.py` that started the ranks
    (both set TORCHELASTIC_USE_AGENT_STORE), or this process when it runs alone."""
    return os.getppid() if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else os.getpid()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _flatten(model_sd: dict, optim_state: dict) -> Tuple[List[Tuple[list, torch.Tensor]], List[list]]:
    """([(path, tensor)], [[path, plain value]]) in a fixed order: the model's, then the optimizer's."""
    tensors, leaves = [], []

    def walk(prefix, tree):
        for key in sorted(tree, key=str):
            value, path = tree[key], prefix + [str(key)]
            if isinstance(value, dict):
                walk(path, value)
            elif isinstance(value, torch.Tensor):
                tensors.append((path, value))
            else:
                leaves.append([path, value])

    walk(["model"], model_sd)
    walk(["optim"], optim_state)
    return tensors, leaves


def _set(tree: dict, path: list, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise SnapshotRefused(f"unknown dtype {name!r}")
    return dtype


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _open_ours(path: str) -> int:
    """A file descriptor for reading `path`: a regular file of this uid, no group or other access,
    never through a link; SnapshotRefused otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SnapshotRefused(f"{path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise SnapshotRefused(f"{path}: not a private file of uid {os.getuid()}")
    return fd


def _create_private(path: str) -> int:
    """`path` created afresh, 0600, O_EXCL | O_NOFOLLOW (a leftover of ours at the name goes first)."""
    _unlink_ours(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _unlink_ours(path: str) -> None:
    try:
        if os.lstat(path).st_uid == os.getuid():
            os.unlink(path)
    except FileNotFoundError:
        pass


class MemorySnapshots:
    """One rank's snapshots: `snapshot(state)` after each step, `restore(state, ckpt)` at the start,
    `close(finished)` at the end. Every rank calls each (they hold collectives)."""

    def __init__(self, cfg, rt, engine):
        c = cfg.checkpoint
        self.cfg, self.rt, self.engine = cfg, rt, engine
        self.interval = c.memory_interval
        self.dir = os.path.abspath(c.memory_dir or DEFAULT_DIR)
        problem = None if os.path.isdir(self.dir) else f"{self.dir} is not a directory on this node"
        problems = [None] * rt.world_size
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            raise UserInputError(
                f"checkpoint.memory_dir={c.memory_dir or DEFAULT_DIR}: {bad[1]} (rank {bad[0]}); give an existing "
                "directory in host memory (a tmpfs such as /dev/shm), or set checkpoint.memory_interval=0"
            )
        self.uid = os.getuid()
        self.job = _job_of(cfg.run_dir)
        pid = _creator_pid()
        self.creator = f"{pid}.{shm_names.start_time(pid)}"
        self.prefix = shm_names.job_prefix(self.uid, self.job, self.creator)
        shm_names.sweep_orphans(self.dir, self.uid)
        self._start_sweeper()
        self._buffers: Dict[str, torch.Tensor] = {}  # host copies, reused snapshot after snapshot
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self.last_copy_s = 0.0  # the step's share of the last snapshot: the copy to host buffers
        self.last_write_s = 0.0  # the writer thread's time for it (beside training)
        self.restore_source, self.restore_s = None, 0.0

    # ---- names ----

    def _name(self, kind: str, rank: int, step: int) -> str:
        return os.path.join(self.dir, f"{self.prefix}-{kind}{rank:05d}-s{step:09d}")

    def _mine(self, kind: str, rank: int) -> Dict[int, str]:
        """step -> manifest path of this job's committed segments of `kind` and `rank`."""
        out = {}
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if (
                f
                and "ext" in f
                and f["ext"] == "json"
                and name.startswith(self.prefix + "-")
                and f["kind"] == kind
                and int(f["rank"]) == rank
            ):
                out[int(f["step"])] = os.path.join(self.dir, name)
        return out

    def _start_sweeper(self) -> None:
        """One sweeper per job and node: whichever rank creates the `.watch` file starts it."""
        watch = os.path.join(self.dir, self.prefix + ".watch")
        try:
            fd = os.open(watch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_names.py")
        proc = subprocess.Popen(
            [sys.executable, "-S", "-E", script, self.dir, self.job, self.creator],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not stopped with the rank's process group
            close_fds=True,
        )
        os.write(fd, str(proc.pid).encode())
        os.close(fd)

    # ---- taking snapshots ----

    def should_snapshot(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def snapshot(self, state) -> None:
        """After step `state.step`: copy what a resume needs to host buffers, then write it in a
        thread. See [Note: a snapshot counts once committed]."""
        step = state.step
        if not self.should_snapshot(step):
            return
        self._agree_previous_written()
        tic = time.perf_counter()
        model_sd, optim_sd = self.engine.get_state_dicts(state.model, state.optimizer)
        optim_tensors, groups = split_optim(optim_sd)
        tensors, leaves = _flatten(model_sd, optim_tensors["state"])
        items = []
        for path, t in tensors:
            local = _local(t).detach()
            key = "/".join(path)
            buf = self._buffers.get(key)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = self._buffers[key] = torch.empty(
                    local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda"
                )
            buf.copy_(local, non_blocking=True)
            items.append((path, buf))
        if any(t.device.type == "cuda" for _, t in tensors):
            torch.cuda.synchronize()
        meta = {
            "format": FORMAT,
            "job": self.job,
            "rank": self.rt.rank,
            "world_size": self.rt.world_size,
            "step": step,
            "train_state": {
                "scheduler": state.scheduler.state_dict(),
                "train_loader": state.train_loader.state_dict(),
                "optimizer_param_groups": groups,
            },
            "rng": rng_state(),
            "leaves": leaves,
        }
        self.last_copy_s = time.perf_counter() - tic
        self._thread = threading.Thread(target=self._write, args=(step, items, meta), name="memory-snapshot")
        self._thread.start()

    def _agree_previous_written(self) -> None:
        """Wait for this rank's writer; every rank learns whether any rank's last write failed."""
        self.wait()
        errors = [None] * self.rt.world_size
        dist.all_gather_object(errors, self._error)
        bad = next(((r, e) for r, e in enumerate(errors) if e), None)
        if bad:
            raise UserInputError(
                f"checkpoint.memory_dir={self.dir}: rank {bad[0]} could not write its snapshot ({bad[1]}); "
                "free memory there, raise checkpoint.memory_interval, or set checkpoint.memory_interval=0"
            )

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, items, meta: dict) -> None:
        tic = time.perf_counter()
        try:
            self._prune(keep=1)  # every rank committed the newest: see [Note: a snapshot counts once committed]
            name = self._name("r", self.rt.rank, step)
            digest, index, offset = hashlib.sha256(), [], 0
            with os.fdopen(_create_private(name + ".data"), "wb") as f:
                for path, buf in items:
                    raw = _bytes(buf)
                    f.write(raw)
                    digest.update(raw)
                    index.append([path, str(buf.dtype), list(buf.shape), offset, raw.nbytes])
                    offset += raw.nbytes
            manifest = {**meta, "tensors": index, "bytes": offset, "sha256": digest.hexdigest()}
            with os.fdopen(_create_private(name + ".json.tmp"), "w") as f:
                json.dump(manifest, f)
            os.rename(name + ".json.tmp", name + ".json")
        except OSError as exc:
            self._error = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        self.last_write_s = time.perf_counter() - tic

    def _prune(self, keep: int, kind: str = "r", rank: Optional[int] = None) -> None:
        """Remove this rank's segments of `kind` but the `keep` newest committed (and torn ones)."""
        rank = self.rt.rank if rank is None else rank
        committed = sorted(self._mine(kind, rank))
        kept = set(committed[-keep:]) if keep else set()
        own = f"{os.path.basename(self.prefix)}-{kind}{rank:05d}-s"
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if f and name.startswith(own) and "step" in f and int(f["step"]) not in kept:
                _unlink_ours(os.path.join(self.dir, name))

    # ---- restoring ----

    def restore(self, state, ckpt) -> int:
        """Every rank: continue from the newest snapshot every rank has whole, or else from the disk
        checkpoint as `ckpt.resume` would (0 without one). Rank 0 says which step and from where."""
        mine = self._mine("r", self.rt.rank)
        shares = [None] * self.rt.world_size
        dist.all_gather_object(shares, sorted(mine))
        common = set(shares[0]).intersection(*map(set, shares[1:]))
        newest = max(common) if common else None
        disk = self._disk_step(ckpt)
        if newest is None or (disk is not None and disk > newest):
            if any(shares):
                why = "no step every rank has" if newest is None else f"the disk's step {disk} is newer"
                return self._from_disk(state, ckpt, f"memory snapshots: {why}")
            return ckpt.resume(state) if ckpt is not None else 0
        tic = time.perf_counter()
        # the templates first, on every rank: the engine's state dicts are collective
        templates = self.engine.get_state_dicts(state.model, state.optimizer)
        problem, loaded = None, None
        try:
            loaded = self._read(mine[newest], *templates)
        except SnapshotRefused as exc:
            problem = str(exc)
        problems = [None] * self.rt.world_size
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            return self._from_disk(
                state, ckpt, f"the memory snapshot of step {newest} on rank {bad[0]} is refused: {bad[1]}"
            )
        self._apply(state, *loaded)
        self.restore_source, self.restore_s = "memory", time.perf_counter() - tic
        if self.rt.is_main:
            print(
                f"restored step {newest} from memory (local, {self.dir}) in {self.restore_s:.3f} s",
                file=sys.stderr,
                flush=True,
            )
        return newest

    def _disk_step(self, ckpt) -> Optional[int]:
        if ckpt is None or self.cfg.checkpoint.resume != "auto":
            return None
        from framework.checkpoint import layout

        try:
            path = layout.latest_checkpoint(ckpt.root)
        except layout.CheckpointError:
            return None
        return layout.step_of(path) if path else None

    def _from_disk(self, state, ckpt, why: str) -> int:
        tic = time.perf_counter()
        step = ckpt.resume(state) if ckpt is not None else 0
        self.restore_source, self.restore_s = "disk", time.perf_counter() - tic
        if self.rt.is_main:
            where = "disk" if step else "the start (no disk checkpoint)"
            print(f"restored step {step} from {where}: {why}", file=sys.stderr, flush=True)
        return step

    def _read(self, manifest_path: str, model_sd: dict, optim_sd: dict):
        """(manifest, the template state dicts filled from the segment); SnapshotRefused if it is
        not whole or not of this job's layout. No collectives: a refusal is this rank's alone."""
        fd = _open_ours(manifest_path)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_MANIFEST_LIMIT + 1)
        try:
            manifest = json.loads(raw)
            ok = (
                len(raw) <= _MANIFEST_LIMIT
                and manifest["format"] == FORMAT
                and manifest["job"] == self.job
                and manifest["rank"] == self.rt.rank
                and manifest["world_size"] == self.rt.world_size
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise SnapshotRefused(f"{manifest_path}: not a snapshot manifest of this job and rank")
        data_path = manifest_path[: -len(".json")] + ".data"
        fd = _open_ours(data_path)
        with os.fdopen(fd, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
        if got != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
            raise SnapshotRefused(f"{data_path}: its bytes do not match its manifest's sha256 (torn or corrupted)")
        optim_tensors, _ = split_optim(optim_sd)
        tensors, _ = _flatten(model_sd, optim_tensors["state"])
        index = manifest["tensors"]
        if [p for p, *_ in index] != [p for p, _ in tensors]:
            raise SnapshotRefused(f"{data_path}: holds other tensors than this job's model and optimizer")
        with torch.no_grad():
            for (path, dtype, shape, offset, nbytes), (_, target) in zip(index, tensors):
                local = _local(target)
                if _dtype(dtype) != local.dtype or list(local.shape) != shape:
                    raise SnapshotRefused(f"{data_path}: {'/'.join(path)} is {dtype}{shape}, this job's {local.dtype}")
                if nbytes:
                    src = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=nbytes)
                    local.copy_(src.view(local.dtype).view(local.shape))
        for path, value in manifest["leaves"]:
            _set(optim_tensors["state"] if path[0] == "optim" else model_sd, path[1:], value)
        return manifest, model_sd, optim_tensors

    def _apply(self, state, manifest: dict, model_sd: dict, optim_tensors: dict) -> None:
        saved = manifest["train_state"]
        self.engine.set_state_dicts(
            state.model, state.optimizer, model_sd, join_optim(optim_tensors, saved["optimizer_param_groups"])
        )
        state.scheduler.load_state_dict(saved["scheduler"])
        state.train_loader.load_state_dict(saved["train_loader"])
        set_rng_state(manifest["rng"])

    # ---- the end ----

    def close(self, finished: bool) -> None:
        """Let the writer end; a finished job removes its segments (a failed one leaves them to a
        restart, and the sweeper removes them once the job's creator ends)."""
        self.wait()
        if finished:
            self._prune(keep=0)


def memory_snapshots(cfg, rt, engine) -> Optional[MemorySnapshots]:
    """The job's snapshots when checkpoint.memory_interval is set, else None."""
    return MemorySnapshots(cfg, rt, engine) if cfg.checkpoint.memory_interval else None
