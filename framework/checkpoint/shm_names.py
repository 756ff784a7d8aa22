"""Names of in-memory snapshot segments, whose they are, and removing those nobody owns any more.

Standard library only: this file also runs on its own as the job's sweeper process
(`python shm_names.py <dir> <job> <creator>`), which must start in a blink and import no torch, and
as the cleanup command of an epilog or a container's exit (`python shm_names.py --sweep [--uid N]
<dir>...`: every dead job's segments of that uid in those directories).

[Note: snapshot segments outlive the rank, not the job]
A segment is a file in checkpoint.memory_dir (/dev/shm by default: host memory) named

    fwsnap-u<uid>-n<pid namespace>-j<job>-c<creator pid>.<creator start time>-<kind><rank>-s<step>.<data|json>

<job> is a hash of the run directory (the same on every rank and every restart), <creator> the
process that outlives the ranks: the torchrun agent, or `python main.py` that forked them (the rank
itself when it is alone). <kind> is `r` for the rank's own snapshot and `p` for a copy held for a
peer on another node. A restarted rank finds the segments of its job whose creator is still alive;
segments whose creator is gone (its pid ended, or now names another process: the start time
differs) are removed at the start of every job on the host (framework/entrypoint.py, any stage,
with or without snapshots, before the config is even checked), by the launcher's cleanup after
the training step (Slurm) or torchrun (a Kubernetes pod), and by the job's sweeper, a small process
started once per job and node that waits for the creator to end and then removes the job's
segments, whether the job finished or failed. The sweeper dies with the job when the whole job is
killed at once (scancel, a cgroup's OOM kill, a container stop): then the next job start or the
cleanup removes them. A pid means something only in its own pid namespace (a container started
with `--ipc=host` shares /dev/shm but not pids), so the name carries the creator's namespace and a
sweep judges only names of its own namespace: another namespace's segments are left alone, live
or not, to a sweep inside it. Names of another uid or another job with a live creator are left
alone, and a file is read only if it is a regular file owned by this uid with no group or other
permissions (opened with O_NOFOLLOW).
"""

from __future__ import annotations

import os
import re
import sys
import time

PREFIX = "fwsnap-"
DEFAULT_DIR = "/dev/shm"  # checkpoint.memory_dir's default
_NAME = re.compile(
    r"^fwsnap-u(?P<uid>\d+)-n(?P<ns>\d+)-j(?P<job>[0-9a-f]+)-c(?P<pid>\d+)\.(?P<start>\d+)-(?P<kind>[rp])(?P<rank>\d+)"
    r"-s(?P<step>\d+)\.(?P<ext>data|json|json\.tmp)$"
)
_WATCH = re.compile(r"^fwsnap-u(?P<uid>\d+)-n(?P<ns>\d+)-j(?P<job>[0-9a-f]+)-c(?P<pid>\d+)\.(?P<start>\d+)\.watch$")


def pid_namespace() -> str:
    """This process's pid namespace (the inode number of /proc/self/ns/pid; "0" if unknown)."""
    try:
        return "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit()) or "0"
    except OSError:
        return "0"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[19])


def alive(creator: str) -> bool:
    """`creator` ("<pid>.<start time>") still runs: its pid exists and started at that time."""
    pid, _, start = creator.partition(".")
    return start_time(int(pid)) == int(start)


def parse(name: str) -> dict | None:
    """The fields of a segment's or a sweeper's name; None for any other name."""
    m = _NAME.match(name) or _WATCH.match(name)
    if m is None:
        return None
    out = m.groupdict()
    out["creator"] = f"{out['pid']}.{out['start']}"
    return out


def job_prefix(uid: int, job: str, creator: str) -> str:
    return f"{PREFIX}u{uid}-n{pid_namespace()}-j{job}-c{creator}"


def sweep_orphans(directory: str, uid: int) -> list:
    """Remove `uid`'s segments in `directory` whose creator (of this pid namespace) is gone;
    returns the names removed."""
    removed, ns = [], pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        fields = parse(name)
        if fields is None or int(fields["uid"]) != uid or fields["ns"] != ns or alive(fields["creator"]):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if st.st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    return removed


def remove_job(directory: str, prefix: str, uid: int) -> None:
    """Remove every file of one job and creator (`prefix`) that this uid owns."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix + "-") or name == prefix + ".watch":
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_uid == uid:
                    os.unlink(path)
            except OSError:
                pass


def watch(directory: str, job: str, creator: str, poll_s: float = 0.2) -> None:
    """The sweeper: wait for the creator to end, then remove the job's segments."""
    uid = os.getuid()
    prefix = job_prefix(uid, job, creator)
    while alive(creator):
        time.sleep(poll_s)
    remove_job(directory, prefix, uid)


def sweep_job_start(memory_dir: str | None = None) -> list:
    """At any job's start: this uid's dead segments in /dev/shm and in `memory_dir` (if another)."""
    dirs = [DEFAULT_DIR] + ([os.path.abspath(memory_dir)] if memory_dir else [])
    return [name for d in dict.fromkeys(dirs) for name in sweep_orphans(d, os.getuid())]


def _cleanup(args: list) -> int:
    """`--sweep [--uid N] <dir>...`: the cleanup command (an epilog runs it as root with the job's uid)."""
    uid = os.getuid()
    if args[:1] == ["--uid"] and len(args) > 1 and args[1].isdigit():
        uid, args = int(args[1]), args[2:]
    for directory in args or [DEFAULT_DIR]:
        for name in sweep_orphans(directory, uid):
            print(f"removed {os.path.join(directory, name)}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sweep"]:
        sys.exit(_cleanup(sys.argv[2:]))
    watch(sys.argv[1], sys.argv[2], sys.argv[3])
