"""In-memory snapshots (checkpoint.memory_interval): a torchrun restart resumes from host memory
before any disk, exactly; a corrupted snapshot is refused by its hash and the disk used; nothing is
left in the snapshot directory once a job has finished or failed. Faults come from
inject/sitecustomize.py, as in test_failures.py; each job's snapshots go to a directory of the
test's own (checkpoint.memory_dir) instead of /dev/shm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, TINY, read_metrics, run_main

INJECT = Path(__file__).resolve().parent / "inject"
ARGS = TINY + [
    "trainer.eval_interval=0",
    "optimizer.schedule=cosine",  # the LR schedule's state is part of what a restore brings back
    "checkpoint.resume=auto",
    "checkpoint.memory_interval=5",
]


def _env(fault: str, shm: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=f"{INJECT}{os.pathsep}{REPO}",
        OMP_NUM_THREADS="1",
        FRAMEWORK_TEST_FAULT=fault,
        FRAMEWORK_TEST_SNAPSHOT_DIR=str(shm),
    )
    return env


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
    reference_shm = tmp_path / "reference_shm"
    reference_shm.mkdir()
    reference = run_main(
        args + [f"checkpoint.memory_dir={reference_shm}", f"hydra.run.dir={tmp_path}/reference"], tmp_path
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")
    assert sorted(expected) == list(range(1, 20))
    assert _left_in(reference_shm) == []  # a finished job's snapshots are gone

    shm = tmp_path / "shm"
    shm.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=2"]
    cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", str(REPO / "main.py"), *args]
    cmd += [f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"]
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
    """At step 7 rank 1 waits for its committed snapshot of step 5 (the `corrupt` fault needs one),
    flips a byte of it and is killed, with no torchrun to restart it: the job fails, and its
    sweeper removes both ranks' snapshots once `main.py` has ended."""
    shm = tmp_path / "shm"
    shm.mkdir()
    out = run_main(
        ARGS + ["trainer.max_steps=9", f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
        env=_env("corrupt:1:7", shm),
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: rank 1 was killed by signal SIGKILL" in out.stderr, out.stderr[-3000:]
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
    reference = run_main(args + [f"hydra.run.dir={tmp_path}/reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")

    port, agents, dirs = free_port(), [], []
    for node in (0, 1):
        cwd, shm = tmp_path / f"node{node}", tmp_path / f"node{node}_shm"
        cwd.mkdir()
        shm.mkdir()
        dirs.append(shm)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
        # A c10d rendezvous, whose agents count restarts differently (an agent restarts its healthy
        # rank for the other node's failure without counting it): the faults name their attempt by
        # its generation ([Note: one store, many attempts]).
        cmd += ["--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=peer"]
        cmd += [str(REPO / "main.py"), *args, f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"]
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
