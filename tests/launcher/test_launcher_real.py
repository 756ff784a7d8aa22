"""The launcher's jobs, run for real: two torchrun agents meeting by c10d rendezvous on 127.0.0.1,
and jobs submitted to a Slurm cluster started by the test (munge, slurmctld, slurmd): one that
trains to the end beside a copy pre-empted mid-run (same losses), and a two-node job.

Each checks what the job wrote: metrics for every step and a complete checkpoint behind the
`latest` pointer, in the fixed run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import slurm_cluster
from launcher_testlib import TINY, free_port, run_launcher

STEPS = 4


def _check_trained(job_dir: Path, total: int = STEPS) -> None:
    run = job_dir / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, total + 1)), records
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / Path(latest).name).is_dir(), latest


def _tail(job_dir: Path) -> str:
    logs = sorted((job_dir / "logs").glob("*")) if job_dir.exists() else []
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


@pytest.mark.timeout(180)
def test_local_two_node_rendezvous(tmp_path):
    """cluster=local cluster.nodes=2: two torchrun agents, 1 rank each, one rendezvous; global rank 0
    is in agent 0, so the saves and the validation loss are on the terminal, not in node 1's log."""
    out = run_launcher(
        [
            "cluster=local",
            "cluster.nodes=2",
            "cluster.nproc_per_node=1",
            *TINY,
            f"trainer.max_steps={STEPS}",
            f"cluster.rdzv_port={free_port()}",
            f"cluster.jobs_dir={tmp_path}/jobs",
        ],
        cwd=tmp_path,
        timeout=150,
    )
    job_dir = Path(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else tmp_path / "none"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + _tail(job_dir)
    assert job_dir.parent == tmp_path / "jobs"
    _check_trained(job_dir)
    # Agent 1 ran as its own torchrun and joined the same rendezvous (2 ranks, one world).
    node1 = (job_dir / "logs" / "training-node1.log").read_text()
    terminal = out.stdout + out.stderr
    assert "saved checkpoint" in terminal and "val_loss" in terminal, terminal[-3000:]
    assert "saved checkpoint" not in node1 and "val_loss" not in node1, node1[-3000:]
    config = (job_dir / "run" / "config.yaml").read_text()
    assert "nodes: 2" in config
    # Running the job again resumes from its last checkpoint: the run is complete, nothing repeats.
    again = subprocess.run(
        ["bash", str(job_dir / "submit.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:] + _tail(job_dir)
    _check_trained(job_dir)


def _losses(job_dir: Path) -> dict:
    records = [
        json.loads(line) for line in (job_dir / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _submit(cluster, tmp_path: Path, steps: int) -> Path:
    out = run_launcher(
        [
            "cluster=slurm",
            "container.runtime=none",
            "cluster.nodes=1",
            "cluster.nproc_per_node=2",
            "cluster.gpus_per_node=0",
            "cluster.cpus_per_task=2",
            *TINY,
            f"trainer.max_steps={steps}",
            "trainer.eval_interval=0",
            "cluster.time_limit=10",
            "+cluster.env.OMP_NUM_THREADS=1",
            f"cluster.jobs_dir={tmp_path}/jobs",
        ],
        cwd=tmp_path,
        env=cluster.env,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_dir = Path(out.stdout.strip().splitlines()[-1])
    (job_id,) = (job_dir / "job_ids").read_text().split()
    assert f"training: {job_id}" in out.stdout
    return job_dir


@pytest.mark.timeout(300)
def test_slurm_job_trains_and_a_preempted_copy_resumes_exactly(tmp_path):
    """Two copies of one job on a one-node Slurm cluster, side by side: the first trains to the end;
    the second gets the pre-emption warning mid-run (what --signal=B:USR1 sends): its ranks save,
    the job requeues itself under the same id and the second start resumes from that checkpoint.
    Every step runs exactly once, and its losses equal the uninterrupted run's."""
    why = slurm_cluster.missing()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    steps = 30
    cluster = slurm_cluster.start(str(tmp_path / "slurm"), cpus=4)  # room for both jobs (2 CPUs each)
    try:
        reference = _submit(cluster, tmp_path, steps)
        preempted = _submit(cluster, tmp_path, steps)
        ref_id = (reference / "job_ids").read_text().split()[0]
        (job_id,) = (preempted / "job_ids").read_text().split()
        metrics = preempted / "run" / "metrics.jsonl"
        deadline = time.time() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.time() < deadline, f"no training progress\n{_tail(preempted)}\n{cluster.logs()}"
            assert cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), _tail(preempted)
            time.sleep(0.2)
        cluster.run("scancel", "--signal=USR1", "--batch", job_id)
        for job_dir, jid in ((reference, ref_id), (preempted, job_id)):
            state = cluster.wait_job(jid, timeout=200)
            assert state == "COMPLETED", f"job {jid} {state}\n{_tail(job_dir)}\n{cluster.logs()}"

        # The uninterrupted job: every step, a complete checkpoint, its log, resume=auto for requeues.
        _check_trained(reference, steps)
        assert (reference / "logs" / f"{reference.name}-{ref_id}.out").exists()
        assert "resume: auto" in (reference / "run" / "config.yaml").read_text()

        # The pre-empted job: requeued once under its id, resumed from the pre-emption checkpoint.
        info = cluster.run("scontrol", "show", "job", "-o", job_id)
        assert "Restarts=1" in info, info
        err = (preempted / "logs" / f"{preempted.name}-{job_id}.err").read_text()
        assert "requeueing job" in err and "resumed from" in err, err[-3000:]
        _check_trained(preempted, steps)  # every step exactly once, in order
        checkpoints = sorted(p.name for p in (preempted / "run" / "checkpoints").glob("step_*"))
        assert len(checkpoints) == 2 and checkpoints[-1] == f"step_{steps:08d}", checkpoints
        # Same losses step by step: fp32 on the CPU with one thread per rank; the resumed run restores
        # weights, optimizer state and the data position exactly, so only summation order could differ
        # (1e-6 relative, the same bound the checkpoint resume tests use).
        ref_losses, losses = _losses(reference), _losses(preempted)
        assert sorted(losses) == sorted(ref_losses) == list(range(1, steps + 1))
        for step in ref_losses:
            assert losses[step] == pytest.approx(ref_losses[step], rel=1e-6), (step, losses[step], ref_losses[step])
    finally:
        cluster.stop()


@pytest.mark.timeout(240)
def test_slurm_two_node_job(tmp_path):
    """cluster.nodes=2 on two slurmd of this machine (this host's name and `localhost`): srun starts
    one torchrun per node, and they meet by c10d rendezvous on the first node of the allocation.
    On the default data settings (the stdlib corpus in the default data.cache_dir)."""
    nodes = [slurm_cluster.local_host(), "localhost"]
    why = slurm_cluster.missing()
    if why:
        pytest.skip(f"no Slurm here: {why}")
    cluster = slurm_cluster.start(str(tmp_path / "slurm"), cpus=1, nodes=nodes)
    try:
        out = run_launcher(
            [
                "cluster=slurm",
                "container.runtime=none",
                "cluster.nodes=2",
                "cluster.nproc_per_node=1",
                "cluster.gpus_per_node=0",
                "cluster.cpus_per_task=1",
                *[a for a in TINY if not a.startswith("data=")],
                "data.seq_len=64",
                f"trainer.max_steps={STEPS}",
                f"cluster.rdzv_port={free_port()}",
                "cluster.time_limit=10",
                "+cluster.env.OMP_NUM_THREADS=1",
                f"cluster.jobs_dir={tmp_path}/jobs",
            ],
            cwd=tmp_path,
            env=cluster.env,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        job_dir = Path(out.stdout.strip().splitlines()[-1])
        (job_id,) = (job_dir / "job_ids").read_text().split()
        state = cluster.wait_job(job_id, timeout=240)
        assert state == "COMPLETED", f"job {job_id} {state}\n{_tail(job_dir)}\n{cluster.logs()}"
        _check_trained(job_dir)
        info = cluster.run("scontrol", "show", "job", "-o", job_id)
        assert "NumNodes=2" in info, info
        assert "nodes: 2" in (job_dir / "run" / "config.yaml").read_text()
    finally:
        cluster.stop()


def test_only_a_machine_without_slurm_or_root_skips_the_slurm_tests(monkeypatch, tmp_path):
    """CI runs as root with slurm-wlm installed: there the Slurm tests run. They skip only where the
    binaries are missing or the user is not root; anything else that stops the test cluster (no
    munge key, a node name that does not resolve) fails them with its reason, before any daemon."""
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "MUNGE_KEY", str(tmp_path / "no-munge.key"))
    assert slurm_cluster.missing() is None
    started = []
    monkeypatch.setattr(slurm_cluster.subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    with pytest.raises(RuntimeError, match=f"^{tmp_path}/no-munge.key missing"):
        slurm_cluster.start(str(tmp_path / "slurm"))
    monkeypatch.setattr(slurm_cluster, "MUNGE_KEY", __file__)  # a file that exists

    def resolve(name):
        if name.endswith(".invalid"):
            raise OSError(f"{name}: no such host")
        return "127.0.0.1"

    monkeypatch.setattr(slurm_cluster.socket, "gethostbyname", resolve)
    with pytest.raises(RuntimeError, match="^node name 'no-such-node.invalid' does not resolve"):
        slurm_cluster.start(str(tmp_path / "slurm"), nodes=["localhost", "no-such-node.invalid"])
    assert started == []

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    assert slurm_cluster.missing() == "starting slurmd needs root"
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda tool: None)
    monkeypatch.setattr(slurm_cluster.os.path, "exists", lambda path: False)
    assert slurm_cluster.missing() == "munged not installed (apt-get install -y slurm-wlm munge)"
