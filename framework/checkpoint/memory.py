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
from framework.checkpoint.contents import rng_state, set_rng_state
from framework.errors import UserInputError

FORMAT = 1
DEFAULT_DIR = shm_names.DEFAULT_DIR
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


def _own_tensors(model, optimizer) -> Tuple[List[Tuple[list, torch.Tensor]], List[list]]:
    """([(path, tensor)], [[path, plain value]]): this rank's parameters, buffers and optimizer
    state as the engine holds them (its local shards: no copies, no collectives), in a fixed order.
    See [Note: a snapshot is the engine's own shards]."""
    tensors, leaves = [], []
    for name, p in model.named_parameters():
        tensors.append((["param", name], p))
        st = optimizer.state.get(p, {})
        for key in sorted(st, key=str):
            value = st[key]
            if isinstance(value, torch.Tensor):
                tensors.append((["optim", name, str(key)], value))
            else:
                leaves.append([["optim", name, str(key)], value])
    for name, b in model.named_buffers():
        tensors.append((["buffer", name], b))
    return tensors, leaves


def _plain(value) -> bool:
    return (
        value is None
        or isinstance(value, (bool, int, float, str))
        or (isinstance(value, (list, tuple)) and all(_plain(v) for v in value))
    )


def _groups(optimizer) -> list:
    """The optimizer's hyper-parameters per group (lr, betas, ...: what the LR schedule and the
    optimizer change between steps), as JSON."""
    return [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _plain(v)}
        for g in optimizer.param_groups
    ]


# [Note: a snapshot is the engine's own shards]
# A disk checkpoint goes through the engine's state dicts (get_state_dicts / set_state_dicts): a
# layout any world size and either engine can load, built with collectives (0.5 s a call for the
# benchmark GPT on 2 CPU ranks, more than a step's tenth). A snapshot is restored only into the
# same job (same world size, engine and model: the manifest and the tensor index are checked), so
# it holds each rank's tensors as the engine itself keeps them: every parameter's local shard, its
# optimizer state and the module buffers, copied as they are. A restarted process has no optimizer
# state yet: the engine's get_state_dicts makes it (a zero-lr step, as for a disk load), and the
# snapshot's bytes are then copied over it, in place, once every rank has found its own whole.


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

    def __init__(self, cfg, rt, engine, planned: Tuple[Optional[str], Optional[int]] = (None, None)):
        """`planned`: the planner's refusal line (None: fits) and one rank's snapshot bytes, every
        generation (None: not planned), from framework/planner/snapshots.py's `planned_snapshots`."""
        c = cfg.checkpoint
        self.cfg, self.rt, self.engine, self._planned = cfg, rt, engine, planned
        self.interval = c.memory_interval
        self.dir = os.path.abspath(c.memory_dir or DEFAULT_DIR)
        # [Note: the peer copy] nodes: blocks of LOCAL_WORLD_SIZE consecutive ranks (torchrun's order)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
        self.nodes = rt.world_size // local if local and rt.world_size % local == 0 else 1
        self._local = rt.world_size // self.nodes  # ranks per node
        self.uid = os.getuid()
        self.job = _job_of(cfg.run_dir)
        pid = _creator_pid()
        self.creator = f"{pid}.{shm_names.start_time(pid)}"
        self.prefix = shm_names.job_prefix(self.uid, self.job, self.creator)
        problem = None
        if not os.path.isdir(self.dir):
            problem = (
                f"checkpoint.memory_dir={c.memory_dir or DEFAULT_DIR}: {self.dir} is not a directory on this node; "
                "give an existing directory in host memory (a tmpfs such as /dev/shm), or set "
                "checkpoint.memory_interval=0"
            )
        elif rt.rank % self._local == 0:  # once per node
            problem = self._fit_problem()
        problems = [None] * rt.world_size
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            raise UserInputError(f"{bad[1]} (rank {bad[0]})" if rt.world_size > 1 else bad[1])
        shm_names.sweep_orphans(self.dir, self.uid)
        self._start_sweeper()
        self._buffers: Dict[str, torch.Tensor] = {}  # host copies, reused snapshot after snapshot
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self.last_copy_s = 0.0  # the step's share of the last snapshot: the copy to host buffers
        self.last_write_s = 0.0  # the writer thread's time for it (beside training)
        self.restore_source, self.restore_s, self._restore_logged = None, 0.0, False
        self._to = (rt.rank + local) % rt.world_size  # holds this rank's copy
        self._from = (rt.rank - local) % rt.world_size  # whose copy this rank holds
        from framework.distributed.groups import new_group  # made with the job's timeout

        self._peer_group = new_group(backend="gloo") if self.nodes > 1 else None

    def _fit_problem(self) -> Optional[str]:
        """A line when this node's snapshots would not fit: the planner's host memory per node, or
        the free space of memory_dir (with what this job's segments already hold there)."""
        problem, rank_bytes = self._planned
        if problem or rank_bytes is None:
            return problem
        need = rank_bytes * self._local * (2 if self.nodes > 1 else 1)  # own, and the copies held
        return fit_problem(self.interval, need, self.dir, self.prefix)

    # ---- metrics ----

    def metrics(self) -> Dict[str, float]:
        """For the step's record: the last snapshot's cost on the step (its copy to host buffers,
        spread over the interval) and its write beside training; once, the restore's time and
        whether it came from memory (1) or the disk (0)."""
        out = {"snapshot_s_per_step": self.last_copy_s / self.interval, "snapshot_write_s": self.last_write_s}
        if self.restore_source and not self._restore_logged:
            out.update(restore_s=self.restore_s, restore_from_memory=float(self.restore_source.startswith("memory")))
            self._restore_logged = True
        return out

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
        tensors, leaves = _own_tensors(state.model, state.optimizer)
        groups = _groups(state.optimizer)
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
        mine = None
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
            mine = name
        except OSError as exc:
            self._error = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        if self._peer_group is not None:
            self._exchange(step, mine)
        self.last_write_s = time.perf_counter() - tic

    # [Note: the peer copy]
    # With more than one node, every snapshot is also kept on the next node: the rank of the same
    # local rank there (ring order over nodes) receives it over a gloo group of its own, in the
    # writer thread, once the owner committed it locally, and keeps it in its own memory_dir as a
    # `p<owner>` segment (committed as its own are: data, then the manifest renamed). A restore
    # takes each rank's shard from its local segment when present and whole, else from the copy
    # its peer holds (sent back over the same group, hash checked by the receiver), else the whole
    # job falls back to the disk. A rank whose own write failed still sends (an empty copy), so
    # the ring never waits on it; the failure is then said at the next snapshot.

    def _exchange(self, step: int, mine: Optional[str]) -> None:
        """Send this rank's committed segment to its peer, keep the one of the rank before. Its two
        buffers (the segment read back to send, the peer's received) are one generation each,
        freed before the next snapshot: counted by framework/planner/snapshots.py."""
        try:
            payload = _read_segment(mine + ".json") if mine else (b"", None)
        except (OSError, SnapshotRefused):
            payload = (b"", None)
        manifest, data = _swap(payload, self._to, self._from, self._peer_group)
        payload = None  # the send buffer goes before the received one is written
        if not manifest:
            return
        try:
            self._prune(keep=1, kind="p", rank=self._from)
            name = self._name("p", self._from, step)
            with os.fdopen(_create_private(name + ".data"), "wb") as f:
                f.write(_bytes(data))
            with os.fdopen(_create_private(name + ".json.tmp"), "wb") as f:
                f.write(manifest)
            os.rename(name + ".json.tmp", name + ".json")
        except OSError as exc:
            self._error = f"the peer copy of rank {self._from}: {exc.strerror or exc}"

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

    def _held(self) -> Dict[int, Dict[int, str]]:
        """owner rank -> step -> manifest path: every committed segment of this job on this node
        (the rank's own and the copies it holds for peers; after a restart that gave the ranks to
        other nodes, any of them)."""
        out: Dict[int, Dict[int, str]] = {}
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if f and f.get("ext") == "json" and name.startswith(self.prefix + "-"):
                out.setdefault(int(f["rank"]), {})[int(f["step"])] = os.path.join(self.dir, name)
        return out

    def restore(self, state, ckpt) -> int:
        """Every rank: continue from the newest snapshot every rank has whole (in its own node's
        memory, or a copy on another node's), or else from the disk checkpoint as `ckpt.resume`
        would (0 without one). Rank 0 says which step and from where. See [Note: the peer copy]."""
        world, me = self.rt.world_size, self.rt.rank
        held = self._held()
        missing = any(not state.optimizer.state.get(p) for p in state.model.parameters() if p.requires_grad)
        shares = [None] * world
        dist.all_gather_object(shares, ({owner: sorted(steps) for owner, steps in held.items()}, missing))
        missing = any(m for _, m in shares)
        shares = [h for h, _ in shares]
        common = None
        for r in range(world):
            steps = {step for share in shares for step in share.get(r, ())}
            common = steps if common is None else common & steps
        newest = max(common) if common else None
        disk = self._disk_step(ckpt)
        if newest is None or (disk is not None and disk > newest):
            if any(shares):
                why = "no step every rank has" if newest is None else f"the disk's step {disk} is newer"
                return self._from_disk(state, ckpt, f"memory snapshots: {why}")
            return ckpt.resume(state) if ckpt is not None else 0
        tic = time.perf_counter()
        # a restarted process has no optimizer state: the engine makes it, on every rank (its state
        # dicts are collective), before the snapshot's bytes go over it
        if missing:
            self.engine.get_state_dicts(state.model, state.optimizer)
        targets = _own_tensors(state.model, state.optimizer)[0]
        problem, loaded = None, None
        try:
            if newest not in held.get(me, {}):
                raise SnapshotRefused(f"no snapshot of step {newest} on this rank's node")
            raw, data, path = _read_pair(held[me][newest])
            loaded = self._parse(raw, data, path, targets)
        except SnapshotRefused as exc:
            problem = str(exc)
        local_problems = [None] * world
        dist.all_gather_object(local_problems, problem)
        sources = {}  # rank whose own is missing or not whole -> the rank on another node sending its copy
        for r, p in enumerate(local_problems):
            if p:
                sources[r] = next(
                    (s for s in range(world) if self._node(s) != self._node(r) and newest in shares[s].get(r, ())),
                    None,
                )
        if any(s is not None for s in sources.values()):
            got = self._fetch(sources, held, newest)
            if problem and sources[me] is not None:
                try:
                    loaded, problem = self._parse(*got, f"the copy rank {sources[me]} holds", targets), None
                except SnapshotRefused as exc:
                    problem = f"{problem}; its copy on rank {sources[me]}: {exc}"
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        bad = next(((r, p) for r, p in enumerate(problems) if p), None)
        if bad:
            why = f"the memory snapshot of step {newest} on rank {bad[0]} is refused: {bad[1]}"
            return self._from_disk(state, ckpt, why)
        self._apply(state, *loaded)
        self.restore_source = "memory (peer)" if sources else "memory"
        self.restore_s = time.perf_counter() - tic
        if self.rt.is_main:
            where = f"local, {self.dir}"
            if sources:
                where += "; for rank(s) " + ", ".join(f"{r} the copy on rank {s}" for r, s in sorted(sources.items()))
            print(
                f"restored step {newest} from memory ({where}) in {self.restore_s:.3f} s", file=sys.stderr, flush=True
            )
        return newest

    def _node(self, rank: int) -> int:
        return rank // self._local

    def _fetch(self, sources: Dict[int, Optional[int]], held, step: int) -> Tuple[bytes, bytearray]:
        """Every rank: send the copies this rank was chosen for, receive this rank's own if it
        needs one (over the peer group, sizes first); (manifest, data) received, or empty."""
        me, group = self.rt.rank, self._peer_group or dist.group.WORLD
        outgoing = [r for r, s in sorted(sources.items()) if s == me]
        payloads = {}
        for r in outgoing:
            try:
                payloads[r] = _read_pair(held[r][step])[:2]
            except (OSError, SnapshotRefused, KeyError):
                payloads[r] = (b"", b"")
        ops, sizes = [], torch.zeros(2, dtype=torch.int64)
        for r in outgoing:
            ops.append(dist.isend(torch.tensor([len(payloads[r][0]), len(payloads[r][1])]), r, group=group))
        if sources.get(me) is not None:
            ops.append(dist.irecv(sizes, sources[me], group=group))
        for op in ops:
            op.wait()
        ops, buf = [], None
        for r in outgoing:
            if payloads[r][0]:
                whole = torch.frombuffer(bytearray(payloads[r][0]) + payloads[r][1], dtype=torch.uint8)
                ops.append(dist.isend(whole, r, group=group))
        if sources.get(me) is not None and int(sizes[0]):
            buf = torch.empty(int(sizes[0] + sizes[1]), dtype=torch.uint8)
            ops.append(dist.irecv(buf, sources[me], group=group))
        for op in ops:
            op.wait()
        if buf is None:
            return b"", bytearray()
        raw = buf.numpy().tobytes()
        return raw[: int(sizes[0])], bytearray(raw[int(sizes[0]) :])

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

    def _parse(self, raw: bytes, data: bytearray, where: str, targets: list):
        """(manifest, [(target tensor, offset, bytes)], data) of a segment's manifest and data
        bytes, checked against this rank's tensors; SnapshotRefused if it is not whole or not this
        rank's of this job's layout. Nothing is written yet (see `_apply`), and no collectives: a
        refusal is this rank's alone."""
        manifest = None
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
            raise SnapshotRefused(
                f"step {manifest.get('step') if isinstance(manifest, dict) else '?'}: not a "
                f"snapshot manifest of this job and rank {self.rt.rank}"
            )
        if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
            raise SnapshotRefused(f"{where}: its bytes do not match its manifest's sha256 (torn or corrupted)")
        index = manifest["tensors"]
        if [p for p, *_ in index] != [p for p, _ in targets]:
            raise SnapshotRefused(f"{where}: holds other tensors than this job's model and optimizer")
        copies = []
        for (path, dtype, shape, offset, nbytes), (_, target) in zip(index, targets):
            local = _local(target)
            if (
                _dtype(dtype) != local.dtype
                or list(local.shape) != shape
                or nbytes != local.numel() * local.element_size()
            ):
                raise SnapshotRefused(f"{where}: {'/'.join(path)} is {dtype}{shape}, this job's {local.dtype}")
            if offset < 0 or offset + nbytes > len(data):
                raise SnapshotRefused(f"{where}: {'/'.join(path)} lies outside the data")
            copies.append((local, offset, nbytes))
        return manifest, copies, data

    def _apply(self, state, manifest: dict, copies: list, data: bytearray) -> None:
        """Every rank found its own whole: the bytes go over the live tensors, then the rest."""
        with torch.no_grad():
            for local, offset, nbytes in copies:
                if nbytes:
                    src = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=nbytes)
                    local.copy_(src.view(local.dtype).view(local.shape))
        params = dict(state.model.named_parameters())
        for path, value in manifest["leaves"]:
            if path[0] == "optim":
                state.optimizer.state[params[path[1]]][path[2]] = value
        saved = manifest["train_state"]
        for group, hyper in zip(state.optimizer.param_groups, saved["optimizer_param_groups"]):
            group.update({k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in hyper.items()})
        state.scheduler.load_state_dict(saved["scheduler"])
        state.train_loader.load_state_dict(saved["train_loader"])
        set_rng_state(manifest["rng"])

    # ---- the end ----

    def close(self, finished: bool) -> None:
        """Let the writer end; a finished job removes its segments, its own and the copies it holds
        for a peer (a failed one leaves them to a restart, and the sweeper removes them once the
        job's creator ends)."""
        self.wait()
        if finished:
            self._prune(keep=0)
            if self._peer_group is not None:
                self._prune(keep=0, kind="p", rank=self._from)


def _read_pair(manifest_path: str) -> Tuple[bytes, bytearray, str]:
    """(manifest bytes, data bytes, the data file's path) of a committed segment, through
    `_open_ours`; `MemorySnapshots._parse` checks them."""
    fd = _open_ours(manifest_path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MANIFEST_LIMIT + 1)
    if len(raw) > _MANIFEST_LIMIT:
        raise SnapshotRefused(f"{manifest_path}: larger than a snapshot manifest")
    data_path = manifest_path[: -len(".json")] + ".data"
    fd = _open_ours(data_path)
    with os.fdopen(fd, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return raw, data, data_path


def _read_segment(manifest_path: str) -> Tuple[bytes, torch.Tensor]:
    """(manifest bytes, data bytes as one uint8 tensor) of a committed segment, through `_open_ours`,
    for sending it: the data is read straight into the tensor that is sent (one buffer)."""
    fd = _open_ours(manifest_path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MANIFEST_LIMIT + 1)
    if len(raw) > _MANIFEST_LIMIT:
        raise SnapshotRefused(f"{manifest_path}: larger than a snapshot manifest")
    fd = _open_ours(manifest_path[: -len(".json")] + ".data")
    with os.fdopen(fd, "rb") as f:
        data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        if data.numel():
            f.readinto(_bytes(data))
    return raw, data


def _swap(payload: Tuple[bytes, Optional[torch.Tensor]], to: int, source: int, group):
    """Send `payload` (manifest bytes, data tensor) to rank `to` and receive one from `source` over
    `group` (sizes first, then the manifest and the data, each as it is: no joined copy); (manifest
    bytes, data tensor) received, (b"", None) when nothing came."""
    manifest, data = payload
    nbytes = data.numel() if data is not None else 0
    sizes = torch.zeros(2, dtype=torch.int64)
    ops = [dist.isend(torch.tensor([len(manifest), nbytes], dtype=torch.int64), to, group=group)]
    ops.append(dist.irecv(sizes, source, group=group))
    for op in ops:
        op.wait()
    ops, got_manifest, got = [], None, None
    if manifest:
        ops.append(dist.isend(torch.frombuffer(bytearray(manifest), dtype=torch.uint8), to, group=group))
        if nbytes:
            ops.append(dist.isend(data, to, group=group))
    if int(sizes[0]):
        got_manifest = torch.frombuffer(bytearray(int(sizes[0])), dtype=torch.uint8)
        ops.append(dist.irecv(got_manifest, source, group=group))
        got = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if int(sizes[1]):
            ops.append(dist.irecv(got, source, group=group))
    for op in ops:
        op.wait()
    if got_manifest is None:
        return b"", None
    return got_manifest.numpy().tobytes(), got


def fit_problem(interval: int, need: int, directory: str, prefix: str) -> Optional[str]:
    """A line when `need` bytes per node do not fit the free space of `directory`, counting the
    space this job's segments (`prefix`) already take there as free (a restart reuses it)."""
    fs = os.statvfs(directory)
    free = fs.f_bavail * fs.f_frsize
    for name in os.listdir(directory):
        if name.startswith(prefix + "-"):
            try:
                free += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass
    if need <= free:
        return None
    gib = 1 << 30
    return (
        f"checkpoint.memory_interval={interval}: the snapshots need {need / gib:.2f} GiB per node in {directory} "
        f"(own and peer copies, two generations), which has {free / gib:.2f} GiB free; give checkpoint.memory_dir "
        "a larger tmpfs, or set checkpoint.memory_interval=0"
    )
