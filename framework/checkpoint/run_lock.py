"""One job per run directory.

[Note: the run directory lock]
Two jobs on one run directory (a resubmitted job while the first still runs) would resume from
each other's checkpoints, prune each other's saves and interleave `metrics.jsonl`. Rank 0 of a
job (the parent under `python main.py`) therefore takes an exclusive `flock` on
`<run dir>/.lock` before it writes anything there, and holds it until the process ends. The
kernel drops the lock when the process dies, however it dies, so a crashed job never leaves it
stale; the file's text (pid, host, start time) only names the holder in the refusal. A symlink
planted as `.lock` is refused, not written through ([Note: no writing through planted links]).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time

from framework.errors import UserInputError
from framework.fileio import open_lock

LOCK_FILE = ".lock"
_held = {}  # run dir -> the open file holding its lock (kept for the life of the process)


def lock_run_dir(run_dir: str) -> None:
    """Take the run directory's lock, or raise UserInputError naming the job that holds it."""
    run_dir = os.path.abspath(run_dir)
    if run_dir in _held:
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    f = open_lock(path)  # held open on purpose: the lock lives as long as the file (never a planted link)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read(200).strip() or "another process"
        f.close()
        raise UserInputError(
            f"hydra.run.dir={run_dir} is in use by a running job ({holder}); wait for it to "
            "finish, or give this job another hydra.run.dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held[run_dir] = f


# [Note: a refused job leaves the run directory as it found it]
# A job refused inside its ranks (a checkpoint that fails its checks, data that does not fit) has
# by then taken the lock (`.lock`) and made `checkpoints/`, perhaps more. The entry point lists the
# run directory before the lock is taken (`entries`); after a refusal the process that holds the
# lock removes what is new there (no other job could have made it: the lock kept them out), drops
# the lock, and removes the run directory itself when nothing else is left in it (Hydra made it
# for this job) and the empty folders above it inside the working directory (Hydra's
# outputs/<date>/), never the working directory or anything above it.
# What was there before, `.lock` of an earlier run included, stays. A crash (status 1) keeps
# everything: its files are what one debugs.


def remove_empty_run_dir(run_dir: str) -> None:
    """Remove `run_dir` if it is empty, then each folder above it while it is empty and lies inside
    the working directory (Hydra made `outputs/<date>/<time>` for the job); the working directory
    and whatever is above it stay, empty or not: they are the user's."""
    cwd = os.path.abspath(os.getcwd())
    path = os.path.abspath(run_dir)
    while path != cwd and (path == os.path.abspath(run_dir) or path.startswith(cwd + os.sep)):
        try:
            os.rmdir(path)  # only an empty folder
        except OSError:
            return
        path = os.path.dirname(path)
        if not path.startswith(cwd + os.sep):
            return


def entries(run_dir: str) -> frozenset:
    """The names in `run_dir` now (none if it does not exist)."""
    try:
        return frozenset(os.listdir(run_dir))
    except OSError:
        return frozenset()


def leave_as_found(run_dir: str, found: frozenset) -> None:
    """Undo what this process's job made in `run_dir` since `found` was listed, if it holds the
    directory's lock (see [Note: a refused job leaves the run directory as it found it])."""
    import shutil

    run_dir = os.path.abspath(run_dir)
    held = _held.pop(run_dir, None)
    if held is None:
        return  # another job's directory, or never claimed: nothing here is this job's
    for name in entries(run_dir) - found:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    held.close()
    remove_empty_run_dir(run_dir)
