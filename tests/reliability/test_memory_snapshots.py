"""In-memory snapshots (checkpoint.memory_interval): a torchrun restart resumes from host memory
before any disk, exactly; a corrupted snapshot is refused by its hash and the disk used; nothing is
left in the snapshot directory once a job has finished or failed. Faults come from
inject/sitecustomize.py, as in test_failures.py; each job's snapshots go to a directory of the
test's own (checkpoint.memory_dir) instead of /dev/shm."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, main_env, read_metrics, run_main, torchrun

INJECT = Path(__file__).resolve().parent / "inject"
ARGS = TINY + [
    "trainer.eval_interval=0",
    "optimizer.schedule=cosine",  # the LR schedule's state is part of what a restore brings back
    "checkpoint.resume=auto",
    "checkpoint.memory_interval=5",
]


def _env(fault: str, shm: Path) -> dict:
    fault_env = {"FRAMEWORK_TEST_FAULT": fault, "FRAMEWORK_TEST_SNAPSHOT_DIR": str(shm)}
    return main_env({"PYTHONPATH": f"{INJECT}{os.pathsep}{REPO}", **fault_env})


def _without_snapshots(args: list) -> list:
    return [a for a in args if not a.startswith("checkpoint.memory_interval=")]


def _losses(run: Path) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run) if "loss" in row}


def _left_in(shm: Path, within_s: float = 10.0) -> list:
    """What is still in `shm` once the job's sweeper had `within_s` to see its creator end."""
    deadline = time.monotonic() + within_s
    while os.listdir(shm) and time.monotonic() < deadline:
        time.sleep(0.1)
    return sorted(os.listdir(shm))


def test_torchrun_restart_resumes_from_memory_then_from_disk_when_the_snapshot_is_corrupted(tmp_path):
    """torchrun --max-restarts=2, checkpoint.interval=13, memory_interval=5, 19 steps. Attempt 0:
    rank 1 is SIGKILLed at step 12, before any disk checkpoint: the job restores step 10 from
    memory. Attempt 1: at step 17 rank 1 flips a byte of its snapshot of step 15, then dies: the
    hash refuses it, and the job restores the disk's step 13. Every step's loss equals the
    uninterrupted run's, bit for bit; nothing is left in the snapshot directory."""
    args = ARGS + ["trainer.max_steps=19", "checkpoint.interval=13"]
    # the uninterrupted run, without snapshots (`python main.py` restarts no rank: refused with them)
    reference = run_main(_without_snapshots(args) + [f"hydra.run.dir={tmp_path}/reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 20))

    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ["--nproc_per_node=2", "--max-restarts=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    cmd = torchrun(flags, [*args, f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"])
    out = subprocess.run(
        cmd,
        cwd=tmp_path,
        env=_env("kill:1:12,corrupt:1:7:1", shm),
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = out.stderr
    assert out.returncode == 0, err[-4000:]
    restores = [line for line in err.splitlines() if line.startswith("restored step")]
    assert len(restores) == 2, err[-4000:]
    assert restores[0].startswith(f"restored step 10 from memory (local, {shm}) in "), restores
    assert restores[1].startswith("restored step 13 from disk: the memory snapshot of step 15 on rank 1 is refused: ")
    assert "do not match its manifest's sha256 (torn or corrupted)" in restores[1], restores
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 20)), sorted(got)
    differ = {step: (got[step], expected[step]) for step in got if got[step] != expected[step]}
    assert not differ, differ  # fp32 on CPU: a restore gives back every bit, so the losses too
    rows = read_metrics(tmp_path / "run")
    # the first record after each restore says where from; every record, the snapshots' cost
    assert [r["restore_from_memory"] for r in rows if "restore_from_memory" in r] == [1.0, 0.0]
    assert all(r["snapshot_s_per_step"] >= 0 and r["snapshot_write_s"] >= 0 for r in rows if "loss" in r)
    assert _left_in(shm) == []


def test_a_failed_job_leaves_no_snapshot_behind(tmp_path):
    """torchrun --max-restarts=1: at step 7 of each attempt rank 1 waits for its committed snapshot
    of step 5 (the `corrupt` fault needs one), flips a byte of it and is killed: the job fails
    after its restart, and the sweeper removes both ranks' snapshots once torchrun has ended."""
    shm = tmp_path / "shm"
    shm.mkdir()
    flags = ["--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"]
    cmd = torchrun(
        flags, [*ARGS, "trainer.max_steps=9", f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"]
    )
    out = subprocess.run(
        cmd, cwd=tmp_path, env=_env("corrupt:1:7:0,corrupt:1:7:1", shm), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in out.stderr or "SIGKILL" in out.stderr, out.stderr[-3000:]
    assert _left_in(shm) == []


def test_a_lost_node_takes_its_shards_from_the_copies_on_the_other_node(tmp_path):
    """Two torchrun agents stand for two nodes (one rank each), each with its own snapshot
    directory. At step 12 node 1 loses its memory (its directory wiped: its own snapshots and the
    copies it held for node 0) and its rank is killed; torchrun restarts both: rank 1 takes its
    step-10 shard from the copy node 0 holds. At step 17 rank 1 flips a byte of its own snapshot
    of step 15 and dies: the hash refuses it and rank 1 takes node 0's copy again. At step 22
    node 1 loses its memory again and node 0's copy of rank 1's step 20 is corrupted too: both
    gone, the job restores the disk's step 18. Every loss equals the uninterrupted run's."""
    from conftest import free_port

    args = ARGS + ["trainer.max_steps=24", "trainer.collective_timeout_s=60", "checkpoint.interval=18"]
    reference = run_main(_without_snapshots(args) + [f"hydra.run.dir={tmp_path}/reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")

    port, agents, dirs = free_port(), [], []
    for node in (0, 1):
        cwd, shm = tmp_path / f"node{node}", tmp_path / f"node{node}_shm"
        cwd.mkdir()
        shm.mkdir()
        dirs.append(shm)
        # A c10d rendezvous, whose agents count restarts differently (an agent restarts its healthy
        # rank for the other node's failure without counting it): the faults name their attempt by
        # its generation ([Note: one store, many attempts]).
        flags = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=peer"]
        cmd = torchrun(flags, [*args, f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"])
        env = _env("wipe:1:12:g1,corrupt:1:7:g2,corruptheld:0:7:g3,wipe:1:7:g3", shm)
        agents.append(
            subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    errs = [a.communicate(timeout=300)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
    restores = [line for line in errs[0].splitlines() if line.startswith("restored step")]
    assert len(restores) == 3, errs[0][-3000:]
    for restore, step in zip(restores, (10, 15)):
        assert restore.startswith(
            f"restored step {step} from memory (local, {dirs[0]}; for rank(s) 1 the copy on rank 0) in "
        ), restores
    assert restores[2].startswith(
        "restored step 18 from disk: the memory snapshot of step 20 on rank 1 is refused: no snapshot of step 20 "
        "on this rank's node; its copy on rank 0: the copy rank 0 holds: its bytes do not match its manifest's "
        "sha256 (torn or corrupted)"
    ), restores
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 25)), sorted(got)
    differ = {step: (got[step], expected[step]) for step in got if got[step] != expected[step]}
    assert not differ, differ
    assert [_left_in(d) for d in dirs] == [[], []]


def _in_private_shm(args: list, tmp_path: Path) -> list:
    """killed_job_driver.py's rounds, run in a mount namespace with a tmpfs of its own on /dev/shm
    (so the host's /dev/shm and other jobs' segments are neither seen nor touched)."""
    if os.geteuid() != 0:
        pytest.skip("a private /dev/shm (unshare -m, mount -t tmpfs) needs root (CI runs as root)")
    driver = Path(__file__).resolve().parent / "killed_job_driver.py"
    script = f'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$0" {driver} {REPO} {tmp_path} "$@"'
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    rounds = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rounds and "error" not in rounds[-1], rounds
    return rounds


def test_a_job_killed_whole_leaves_nothing_once_the_next_job_starts_or_the_cleanup_runs(tmp_path):
    """A torchrun job with memory snapshots in /dev/shm is killed whole: every process it started
    (torchrun, both ranks, the snapshot sweeper) stopped, then SIGKILLed, so nothing of it sees the
    others end. Its segments stay (two ranks' committed snapshots and the sweeper's mark); then
    (1) the next job's start removes them, even a job refused right after its config (memory
    snapshots under `python main.py`, which never restarts ranks), and (2) the launcher's cleanup
    command removes them. Run while the job lives, neither touches its segments."""
    rounds = _in_private_shm(["refused", "cleanup"], tmp_path)
    assert [r["then"] for r in rounds] == ["refused", "cleanup"], rounds
    for r in rounds:
        # the live job's sweeper mark and both ranks' committed snapshots are still there (the job
        # itself replaces a generation meanwhile, so the names of its steps may have moved on)
        watch = [n for n in r["live"] if n.endswith(".watch")]
        assert len(watch) == 1 and watch[0] in r["after_live"], r
        assert {n.rsplit("-r", 1)[1][:5] for n in r["after_live"] if n.endswith(".json")} == {"00000", "00001"}, r
        assert r["killed"], r  # something was left behind to remove
        assert any(n.endswith(".watch") for n in r["killed"]), r["killed"]
        assert r["left"] == [], r
    refused = rounds[0]
    assert refused["status"] == 2 and refused["during_status"] == 2, refused
    line = [x for x in refused["err"].splitlines() if x.startswith("error:")]
    assert line == [
        "error: checkpoint.memory_interval=5: memory snapshots are read only by restarted ranks, and this job has no "
        "restarts (python main.py never restarts its ranks; nor does torchrun without --max-restarts); run it with "
        "torchrun --max-restarts=N (N > 0), or set checkpoint.memory_interval=0"
    ], refused["err"]
    assert rounds[1]["status"] == 0 and rounds[1]["during_status"] == 0, rounds[1]


def test_a_finished_job_removes_the_copies_it_held_for_the_other_node(tmp_path):
    """Two torchrun agents stand for two nodes (one rank each), memory snapshots every 5 steps with
    a copy on the other node. Each node's sweeper is stopped (SIGSTOP) as soon as it starts, so
    only the job itself can remove anything: once the job has finished, each directory holds
    nothing but the stopped sweeper's mark (no own snapshot, no copy held for the other node).
    Let go, the sweepers remove the marks."""
    import signal
    import threading

    from conftest import free_port

    port, agents, dirs = free_port(), [], [tmp_path / "node0_shm", tmp_path / "node1_shm"]
    stopped, done = {}, threading.Event()

    def stop_sweepers():
        while not done.is_set():
            for d in dirs:
                for name in os.listdir(d):
                    if name.endswith(".watch") and name not in stopped:
                        pid = (d / name).read_text()
                        if pid:
                            os.kill(int(pid), signal.SIGSTOP)
                            stopped[name] = int(pid)
            time.sleep(0.01)

    for node, shm in enumerate(dirs):
        shm.mkdir()
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        flags = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=done"]
        args = [*ARGS, "trainer.max_steps=12", f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"]
        cmd = torchrun(flags, args)
        agents.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=_env("", shm), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        )
    watcher = threading.Thread(target=stop_sweepers, daemon=True)
    watcher.start()
    try:
        errs = [a.communicate(timeout=300)[1] for a in agents]
        assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
        done.set()
        watcher.join()
        assert len(stopped) == 2, stopped  # each node's sweeper was held before it could remove anything
        held = [sorted(os.listdir(d)) for d in dirs]
        assert [[n for n in names if not n.endswith(".watch")] for names in held] == [[], []], held
    finally:
        done.set()
        watcher.join()
        for pid in stopped.values():  # never leave a stopped process behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert [_left_in(d) for d in dirs] == [[], []]


_POD = """
import os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from framework.checkpoint import shm_names

def segment(creator):
    name = shm_names.job_prefix(os.getuid(), "abc123", creator) + "-r00000-s000000005.data"
    open(os.path.join("/dev/shm", name), "w").close()
    return name

gone = subprocess.Popen([sys.executable, "-c", "pass"])
start = shm_names.start_time(gone.pid)
gone.wait()
segment(f"{gone.pid}.{start}")  # a job killed whole before this container started
job = (
    "import os, sys; sys.path.insert(0, sys.argv[1]); from framework.checkpoint import shm_names; "
    "print(sorted(os.listdir('/dev/shm'))); "
    "open(os.path.join('/dev/shm', shm_names.job_prefix(os.getuid(), 'def456', "
    "f'{os.getpid()}.{shm_names.start_time(os.getpid())}') + '-r00000-s000000005.data'), 'w').close(); "
    "os.kill(os.getpid(), 9)"
)
out = subprocess.run(
    [sys.executable, "-m", "launcher_scripts.pod_entry", sys.executable, "-c", job, sys.argv[1]],
    cwd=sys.argv[1], capture_output=True, text=True,
)
print(out.returncode, out.stdout.strip(), sorted(os.listdir("/dev/shm")))
"""


def test_the_pod_entry_removes_dead_jobs_snapshots_before_and_after_torchrun(tmp_path):
    """In a private /dev/shm: a dead job's segment is there when the pod's entry starts; the command
    it runs (standing for torchrun) sees it gone, leaves a segment of its own and is SIGKILLed (its
    sweeper never started): once the entry has ended, nothing is left."""
    if os.geteuid() != 0:
        pytest.skip("a private /dev/shm (unshare -m, mount -t tmpfs) needs root (CI runs as root)")
    script = 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$0" "$@"'
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable, "-c", _POD, str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    status, seen, left = out.stdout.strip().split(" ", 2)
    assert (status, seen, left) == ("137", "[]", "[]"), out.stdout
