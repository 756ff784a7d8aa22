"""The files of in-memory snapshots in checkpoint.memory_dir: created private and whole, read only
if private and ours, named per job, rank and step, pruned to what a restore may need, and the
sweeper that removes a job's files once the process that started its ranks is gone (names,
ownership and sweeping: [Note: snapshot segments outlive the rank, not the job] in shm_names.py).

[Note: a snapshot counts once committed]
A rank's snapshot of step N is two files: `<name>.data` (every tensor's bytes, back to back) and
`<name>.json` (the index of those bytes, the train state, the RNG states and the data file's
sha256). The data file is created with O_EXCL | O_NOFOLLOW, mode 0600, and written whole; the
manifest is written to `<name>.json.tmp` and renamed over `<name>.json`, last: a snapshot with
no manifest was torn (the rank died while writing it) and does not exist for a restore. Before a
rank writes step N it waits for its previous write and the ranks agree that every one of those
writes succeeded (one all_gather): so every rank has committed step N - interval before any rank
removes older generations, and a rank keeps at most two (the newest committed and the one being
written). A restore takes the newest step every rank has committed, checks each data file
against its manifest's hash, and uses it only if every rank's is whole; otherwise the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from typing import Dict, Optional, Tuple

import torch

from framework.checkpoint import shm_names
from framework.checkpoint.snapshot_format import MANIFEST_LIMIT, SnapshotRefused, as_bytes


def open_ours(path: str) -> int:
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


def create_private(path: str) -> int:
    """`path` created afresh, 0600, O_EXCL | O_NOFOLLOW (a leftover of ours at the name goes first)."""
    unlink_ours(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def unlink_ours(path: str) -> None:
    try:
        if os.lstat(path).st_uid == os.getuid():
            os.unlink(path)
    except FileNotFoundError:
        pass


def _read_manifest(manifest_path: str) -> bytes:
    fd = open_ours(manifest_path)
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MANIFEST_LIMIT + 1)
    if len(raw) > MANIFEST_LIMIT:
        raise SnapshotRefused(f"{manifest_path}: larger than a snapshot manifest")
    return raw


def read_pair(manifest_path: str) -> Tuple[bytes, bytearray, str]:
    """(manifest bytes, data bytes, the data file's path) of a committed segment, through
    `open_ours`; snapshot_format.parse checks them."""
    raw = _read_manifest(manifest_path)
    data_path = manifest_path[: -len(".json")] + ".data"
    fd = open_ours(data_path)
    with os.fdopen(fd, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return raw, data, data_path


def read_segment(manifest_path: str) -> Tuple[bytes, torch.Tensor]:
    """(manifest bytes, data bytes as one uint8 tensor) of a committed segment, through `open_ours`,
    for sending it: the data is read straight into the tensor that is sent (one buffer)."""
    raw = _read_manifest(manifest_path)
    fd = open_ours(manifest_path[: -len(".json")] + ".data")
    with os.fdopen(fd, "rb") as f:
        data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        if data.numel():
            f.readinto(as_bytes(data))
    return raw, data


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


class Segments:
    """One job's snapshot files in `directory` (`prefix`: its uid, job and creator, shm_names.py):
    `r<rank>` segments are a rank's own, `p<rank>` the copies a rank holds for a peer on another
    node. Holds no state of its own: every answer is read from the directory."""

    def __init__(self, directory: str, prefix: str) -> None:
        self.dir, self.prefix = directory, prefix

    def name(self, kind: str, rank: int, step: int) -> str:
        return os.path.join(self.dir, f"{self.prefix}-{kind}{rank:05d}-s{step:09d}")

    def committed(self, kind: str, rank: int) -> Dict[int, str]:
        """step -> manifest path of this job's committed segments of `kind` and `rank`."""
        out = {}
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if (
                f
                and f.get("ext") == "json"
                and name.startswith(self.prefix + "-")
                and f["kind"] == kind
                and int(f["rank"]) == rank
            ):
                out[int(f["step"])] = os.path.join(self.dir, name)
        return out

    def held(self) -> Dict[int, Dict[int, str]]:
        """owner rank -> step -> manifest path: every committed segment of this job here (a rank's
        own and the copies it holds for peers; after a restart that gave the ranks to other
        nodes, any of them)."""
        out: Dict[int, Dict[int, str]] = {}
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if f and f.get("ext") == "json" and name.startswith(self.prefix + "-"):
                out.setdefault(int(f["rank"]), {})[int(f["step"])] = os.path.join(self.dir, name)
        return out

    def prune(self, rank: int, keep: int, kind: str = "r") -> None:
        """Remove `rank`'s segments of `kind` but the `keep` newest committed (and torn ones)."""
        committed = sorted(self.committed(kind, rank))
        kept = set(committed[-keep:]) if keep else set()
        own = f"{os.path.basename(self.prefix)}-{kind}{rank:05d}-s"
        for name in os.listdir(self.dir):
            f = shm_names.parse(name)
            if f and name.startswith(own) and "step" in f and int(f["step"]) not in kept:
                unlink_ours(os.path.join(self.dir, name))

    def write_own(self, rank: int, step: int, items, head: dict) -> str:
        """Commit rank `rank`'s segment of `step`: the host buffers `items` ([(path, tensor)]) as the
        data file, then the manifest (`head` and their index) renamed into place ([Note: a
        snapshot counts once committed]); its name. OSError as the file system gives it."""
        name = self.name("r", rank, step)
        digest, index, offset = hashlib.sha256(), [], 0
        with os.fdopen(create_private(name + ".data"), "wb") as f:
            for path, buf in items:
                raw = as_bytes(buf)
                f.write(raw)
                digest.update(raw)
                index.append([path, str(buf.dtype), list(buf.shape), offset, raw.nbytes])
                offset += raw.nbytes
        manifest = {**head, "tensors": index, "bytes": offset, "sha256": digest.hexdigest()}
        with os.fdopen(create_private(name + ".json.tmp"), "w") as f:
            json.dump(manifest, f)
        os.rename(name + ".json.tmp", name + ".json")
        return name

    def write_copy(self, owner: int, step: int, manifest: bytes, data: torch.Tensor) -> None:
        """Commit the copy of `owner`'s segment of `step` received from its node, as `write_own`."""
        name = self.name("p", owner, step)
        with os.fdopen(create_private(name + ".data"), "wb") as f:
            f.write(as_bytes(data))
        with os.fdopen(create_private(name + ".json.tmp"), "wb") as f:
            f.write(manifest)
        os.rename(name + ".json.tmp", name + ".json")

    def start_sweeper(self, job: str, creator: str) -> None:
        """One sweeper per job and node: whichever rank creates the `.watch` file starts it."""
        watch = os.path.join(self.dir, self.prefix + ".watch")
        try:
            fd = os.open(watch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_names.py")
        proc = subprocess.Popen(
            [sys.executable, "-S", "-E", script, self.dir, job, creator],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not stopped with the rank's process group
            close_fds=True,
        )
        os.write(fd, str(proc.pid).encode())
        os.close(fd)
