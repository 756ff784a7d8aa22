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
