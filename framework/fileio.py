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


def create_temporary(path: str, binary: bool = False):
    """`path` created afresh for writing (a temporary about to be renamed over its final name):
    whatever held the name is removed first, and the new file is opened with O_EXCL | O_NOFOLLOW."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            raise _refuse(path, "a directory")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb" if binary else "w")
