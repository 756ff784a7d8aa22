"""Opening the files a job writes in its run directory without being led elsewhere.

[Note: no writing through planted links]
A run directory may be shared, copied or prepared by someone else. A symlink planted under one of
the names a job writes (`.lock`, `metrics.jsonl`, `checkpoints/latest.tmp`, a manifest's `.tmp`)
would otherwise make the job overwrite the file it points to. So:
- a file the job appends to or keeps open is opened with `O_NOFOLLOW` and must be a regular file;
  a link or a special file there is refused in one line naming it (`PlantedFileError`);
- a temporary file (written, fsynced, then renamed over its final name) is created with
  `O_EXCL | O_NOFOLLOW` after removing whatever held its name: removing a link removes the link,
  never its target, and `os.replace` onto a final name replaces a link there, not what it names.
Reads of what a checkpoint holds follow [Note: files stay inside] in checkpoint/layout.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from framework.errors import UserInputError


class PlantedFileError(UserInputError):
    """A symlink or special file where the job writes a regular file of its own."""


def _refuse(path: str, what: str) -> PlantedFileError:
    return PlantedFileError(
        f"{path} is {what}, where this job writes a file of its own; it is not written through: "
        "remove it (or give the job another hydra.run.dir)"
    )


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """`os.open(path, flags | O_NOFOLLOW | O_NONBLOCK)` that refuses a symlink or a non-regular
    file at `path` (a FIFO does not block the open) with a PlantedFileError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "a symlink") from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise _refuse(path, "not a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refuse(path, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def open_append(path: str, buffering: int = -1):
    """A text file opened for appending (created if missing), never through a planted link."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", buffering=buffering)


def open_lock(path: str):
    """A file opened for reading and writing (created if missing), for a lock, never through a link."""
    return os.fdopen(open_regular(path, os.O_RDWR | os.O_CREAT), "r+")


def read_json(path: str):
    """The JSON in `path` (a config.json, an index a library wrote); a file that is not UTF-8 JSON
    is one refusal naming it."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"not JSON ({getattr(exc, 'msg', exc)})"
        raise UserInputError(f"{path} is {why}; give the file save_pretrained wrote") from None


def create_temporary(path: str, mode: str = "w"):
    """`path` created afresh for writing (a temporary about to be renamed over its final name):
    whatever held the name is removed first, and the new file is opened with O_EXCL | O_NOFOLLOW."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            raise _refuse(path, "a directory")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, mode)


# [Note: leftovers of killed jobs]
# Two things a job makes outside its run directory outlive a SIGKILL: the launcher's per-job
# report directory (/tmp/framework-ranks-*) and, for the instant between rank 0 creating and
# unlinking it, the shared-memory segment of the host transport (/dev/shm/fsdp-collectives-*).
# Both carry their creator's pid namespace and pid in their name (`owner_tag`), and every job
# start removes those whose creator is gone (`sweep_leftovers`): same pid namespace (a pid means
# nothing in another), same owner uid, and no process with that pid. A live job's are never touched.


def pid_namespace() -> str:
    try:
        return "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit()) or "0"
    except OSError:
        return "0"


def owner_tag() -> str:
    """`<pid namespace>-<pid>`: names what this process leaves outside its run directory."""
    return f"{pid_namespace()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead(directory: str, prefix: str) -> list:
    """Remove entries `<directory>/<prefix><ns>-<pid>-...` whose creator (this pid namespace, this
    uid) no longer runs; returns the removed paths."""
    import shutil

    removed, ns = [], pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("-")
        if len(parts) < 3 or parts[0] != ns or not parts[1].isdigit():  # noqa: PLR2004 - ns, pid, rest
            continue
        path = os.path.join(directory, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _alive(int(parts[1])):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except OSError:
            continue
    return removed


RANKS_PREFIX = "framework-ranks-"
SHM_PREFIX = "fsdp-collectives-"


def sweep_leftovers() -> None:
    """At a job's start: remove what killed jobs of this host left (see [Note: leftovers of killed jobs])."""
    import tempfile

    sweep_dead(tempfile.gettempdir(), RANKS_PREFIX)
    sweep_dead("/dev/shm", SHM_PREFIX)
