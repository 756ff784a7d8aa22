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
Every other file a job writes whole (an export's weights, config and tokenizer files, plan.json, a
profile's trace, prepared data) goes the temporary's way: `replace_file` for our own writes,
`written_by_path` for a library that writes by path (it gets the temporary we created), so a link
at the final name is replaced by the job's file. A directory the job fills afresh (an export) is
made by `own_directory`, which replaces a link at its name by a directory of the job's own.
Reads of what a checkpoint holds follow [Note: files stay inside] in checkpoint/layout.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Optional

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
    whatever held the name is removed first, and the new file is opened with O_EXCL | O_NOFOLLOW.
    Text modes write UTF-8."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            raise _refuse(path, "a directory")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8")


@contextlib.contextmanager
def replace_file(path: str, mode: str = "w"):
    """A file handle whose contents become `path` whole: written to `<path>.tmp` (create_temporary),
    fsynced, then renamed over `path`. A link planted at either name is replaced, never written
    through; if the block raises, the temporary is removed and `path` is left as it was."""
    tmp = path + ".tmp"
    handle = create_temporary(tmp, mode)
    try:
        with handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


@contextlib.contextmanager
def written_by_path(path: str, tmp: str = ""):
    """The name a library should write `path` under, for a library that opens its file by name
    (torch's profiler, megatron's builder): a temporary (`<path>.tmp` or `tmp`) this process created
    empty with O_EXCL | O_NOFOLLOW, so the library writes into our own file; renamed over `path`
    when the block ends, removed if it raises."""
    tmp = tmp or path + ".tmp"
    create_temporary(tmp, "wb").close()
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


def write_json(path: str, obj, **dump_args) -> None:
    """`obj` as JSON in `path`, through `replace_file`."""
    import json

    with replace_file(path) as handle:
        json.dump(obj, handle, **dump_args)


def copy_file(source: str, path: str) -> None:
    """`source`'s bytes as `path`, through `replace_file` (shutil.copyfile would write through a link at `path`)."""
    import shutil

    with open(source, "rb") as src, replace_file(path, "wb") as dst:
        shutil.copyfileobj(src, dst)


def own_directory(path: str) -> str:
    """`path` as a directory this job writes into: made if missing; a link there (to someone's
    directory, or dangling) is removed first and a directory of the job's own made in its place;
    a file or special file there is refused. Returns `path`."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.lexists(path) and not os.path.isdir(path):
        raise PlantedFileError(
            f"{path} is a file, where this job makes a directory of its own; "
            "remove it (or give the job another directory)"
        )
    os.makedirs(path, exist_ok=True)
    return path


# [Note: a directory link is followed only if it is yours]
# Users put `checkpoints/` (or `eval/`) on a big disk with a link in the run directory; someone else
# can plant the same link to make the job write into (and replace `latest` or a results file in)
# a directory of theirs or of a third party. The job cannot tell the two apart by the link alone,
# so it decides by ownership: a directory link the job writes through is followed only when the
# link itself (lstat) and the directory it leads to (stat) both belong to the user running the
# job; any other link there (another user's link, a link to another user's directory, a link to a
# file or to nothing) is refused in one line naming the path, before any rank starts and again
# where the directory is first used. The target's path is not printed: it is someone else's text.


def directory_link_problem(path: str, field: str) -> Optional[str]:
    """The refusal of a link at `path`, a directory the job writes into, unless the link and its
    target are the running user's ([Note: a directory link is followed only if it is yours]);
    None for a link that may be followed and for anything that is not a link."""
    try:
        link = os.lstat(path)
    except OSError:
        return None  # missing: the job makes its own directory there
    if not stat.S_ISLNK(link.st_mode):
        return None
    uid = os.getuid()
    try:
        target = os.stat(path)
    except OSError:
        target = None
    if link.st_uid != uid:
        why = f"a link owned by uid {link.st_uid}"
    elif target is None or not stat.S_ISDIR(target.st_mode):
        why = "a link to no directory"
    elif target.st_uid != uid:
        why = f"a link to a directory owned by uid {target.st_uid}"
    else:
        return None
    return (
        f"{field}: {path} is {why}, not this job's user's (uid {uid}); a job writes through a directory "
        "link only when the link and its directory are yours: remove the link, or make it (and its "
        "directory) your own"
    )


def users_directory(path: str, field: str) -> str:
    """`path` as a directory the job writes into (made if missing), a link there followed only if
    it is the user's own ([Note: a directory link is followed only if it is yours]); returns `path`."""
    problem = directory_link_problem(path, field)
    if problem:
        raise PlantedFileError(problem)
    os.makedirs(path, exist_ok=True)
    return path


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
