"""Snapshot segments: whose they are, which are swept, which are never read (framework/checkpoint/
shm_names.py, snapshot_files.py; [Note: snapshot segments outlive the rank, not the job])."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from framework.checkpoint import shm_names
from framework.checkpoint.snapshot_files import create_private, open_ours
from framework.checkpoint.snapshot_format import SnapshotRefused


def _dead_creator() -> str:
    proc = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    start = shm_names.start_time(proc.pid)
    proc.wait()
    return f"{proc.pid}.{start or 1}"


def _me() -> str:
    return f"{os.getpid()}.{shm_names.start_time(os.getpid())}"


def test_sweep_removes_only_this_uids_segments_whose_creator_is_gone(tmp_path):
    uid, dead, live = os.getuid(), _dead_creator(), _me()
    names = {
        "dead": f"{shm_names.job_prefix(uid, 'abc123', dead)}-r00000-s000000005.data",
        "dead_manifest": f"{shm_names.job_prefix(uid, 'abc123', dead)}-p00001-s000000005.json",
        "dead_watch": f"{shm_names.job_prefix(uid, 'abc123', dead)}.watch",
        "live": f"{shm_names.job_prefix(uid, 'def456', live)}-r00000-s000000005.data",
        "other_uid": f"{shm_names.job_prefix(uid + 4242, 'abc123', dead)}-r00000-s000000005.data",
        "not_ours": "fwsnap-something-else",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    if uid == 0:  # root can make a file of another uid: it stays whatever its name says
        os.chown(tmp_path / names["other_uid"], 4242, 4242)
        lying = f"{shm_names.job_prefix(uid, 'abc123', dead)}-r00001-s000000005.data"
        (tmp_path / lying).write_bytes(b"x")
        os.chown(tmp_path / lying, 4242, 4242)
        names["lying_name"] = lying
    removed = shm_names.sweep_orphans(str(tmp_path), uid)
    assert sorted(removed) == sorted([names["dead"], names["dead_manifest"], names["dead_watch"]])
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(n for k, n in names.items() if not k.startswith("dead")), left


def test_creator_alive_needs_the_same_start_time():
    pid = os.getpid()
    assert shm_names.alive(_me())
    assert not shm_names.alive(f"{pid}.{shm_names.start_time(pid) + 1}")  # a pid reused by another process
    assert not shm_names.alive(_dead_creator())


def test_a_segment_is_created_private_and_read_only_if_private_and_ours(tmp_path):
    path = tmp_path / "seg.data"
    os.close(create_private(str(path)))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.close(open_ours(str(path)))

    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    os.chmod(target, 0o600)
    link = tmp_path / "link.data"
    link.symlink_to(target)
    with pytest.raises(SnapshotRefused, match="link.data"):
        open_ours(str(link))  # never read through a link
    os.close(create_private(str(link)))  # a planted link of ours is replaced, not written through
    assert target.read_bytes() == b"secret" and not os.path.islink(link)

    shared = tmp_path / "shared.data"
    shared.write_bytes(b"x")
    os.chmod(shared, 0o644)
    with pytest.raises(SnapshotRefused, match="not a private file of uid"):
        open_ours(str(shared))
    if os.getuid() == 0:
        theirs = tmp_path / "theirs.data"
        theirs.write_bytes(b"x")
        os.chmod(theirs, 0o600)
        os.chown(theirs, 4242, 4242)
        with pytest.raises(SnapshotRefused, match="not a private file of uid"):
            open_ours(str(theirs))


def test_the_sweeper_removes_a_jobs_segments_once_its_creator_ends(tmp_path):
    creator = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(30)"])
    try:
        tag = f"{creator.pid}.{shm_names.start_time(creator.pid)}"
        prefix = shm_names.job_prefix(os.getuid(), "abc123", tag)
        mine = [f"{prefix}-r00000-s000000005.data", f"{prefix}-r00000-s000000005.json", f"{prefix}.watch"]
        other = f"{shm_names.job_prefix(os.getuid(), 'fed987', tag)}-r00000-s000000005.data"
        for name in [*mine, other]:
            (tmp_path / name).write_bytes(b"x")
        script = os.path.join(os.path.dirname(shm_names.__file__), "shm_names.py")
        sweeper = subprocess.Popen([sys.executable, "-S", "-E", script, str(tmp_path), "abc123", tag])
        assert sweeper.poll() is None
        creator.kill()
        creator.wait()
        assert sweeper.wait(timeout=30) == 0
        assert os.listdir(tmp_path) == [other]  # another job's segment is not this sweeper's
    finally:
        creator.kill()


def test_a_sweep_judges_only_its_own_pid_namespace(tmp_path):
    """A pid names a process only in its own pid namespace (a container started with --ipc=host
    shares /dev/shm, not pids): a segment named with another namespace stays, whatever its pid."""
    uid, dead = os.getuid(), _dead_creator()
    ours = f"{shm_names.job_prefix(uid, 'abc123', dead)}-r00000-s000000005.data"
    assert f"-n{shm_names.pid_namespace()}-" in ours
    theirs = ours.replace(f"-n{shm_names.pid_namespace()}-", "-n1-")
    for name in (ours, theirs):
        (tmp_path / name).write_bytes(b"x")
    assert shm_names.sweep_orphans(str(tmp_path), uid) == [ours]
    assert os.listdir(tmp_path) == [theirs]


def test_the_cleanup_command_sweeps_the_named_uid(tmp_path):
    """`python shm_names.py --sweep [--uid N] <dir>...`, as an epilog runs it for the job's user."""
    uid, dead, live = os.getuid(), _dead_creator(), _me()
    other = uid + 4242
    names = [
        f"{shm_names.job_prefix(other, 'abc123', dead)}-r00000-s000000005.data",
        f"{shm_names.job_prefix(other, 'def456', live)}-r00000-s000000005.data",
        f"{shm_names.job_prefix(uid, 'abc123', dead)}-r00000-s000000005.data",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        if name.startswith(f"fwsnap-u{other}-") and uid == 0:
            os.chown(tmp_path / name, other, other)
    script = shm_names.__file__
    out = subprocess.run(
        [sys.executable, "-S", script, "--sweep", "--uid", str(other), str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    if uid == 0:  # only root can own a file of another uid: then the dead one of that uid goes
        assert out.stdout == f"removed {tmp_path / names[0]}\n"
        assert sorted(os.listdir(tmp_path)) == sorted(names[1:])
    else:  # the files are this uid's, whatever their names say: nothing is removed
        assert out.stdout == "" and sorted(os.listdir(tmp_path)) == sorted(names)
