"""The generated scripts run (with stand-ins for srun, sbatch, kubectl, python) and the launcher's
command line: refusal, dry run, submission, the last line of its output.

The stand-ins record their argv, so what a shell hands to a program is checked exactly: an
override full of shell syntax must arrive as one unchanged argument and run nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_testlib import INJECTED_VALUE, INJECTION, RECORDER, TINY, render_case, run_launcher, write_exe
from omegaconf import OmegaConf

from framework.config import Config, to_config
from launcher_scripts.config import LauncherConfig, SlurmCluster, to_launcher_config


def _fake_bin(tmp_path: Path, *names: str, extra: dict = None) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        write_exe(bin_dir / name, RECORDER)
    for name, text in (extra or {}).items():
        write_exe(bin_dir / name, text)
    return bin_dir


def _calls(log_dir: Path, name: str):
    path = log_dir / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fake_path(tmp_path: Path, bin_dir: Path) -> dict:
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path)}


def _env(tmp_path: Path, bin_dir: Path, **extra) -> dict:
    env = {**os.environ, **_fake_path(tmp_path, bin_dir), **extra}
    return env


SCONTROL = """#!/usr/bin/env bash
if [ "$1" = show ]; then echo node-a; echo node-b; exit 0; fi
echo "$@" >> "$FAKE_LOG/scontrol.calls"
"""


def test_sbatch_script_hands_the_injection_to_main_py_as_one_argument(tmp_path):
    job_dir = str(tmp_path / "job")
    script = tmp_path / "training.sbatch"
    script.write_text(render_case("slurm_none", job_dir=job_dir)["training.sbatch"])
    bin_dir = _fake_bin(tmp_path, "srun", extra={"scontrol": SCONTROL})
    env = _env(tmp_path, bin_dir, SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES="1")
    out = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    argv, sweep = _calls(tmp_path, "srun")  # the training step, then the snapshot sweep on every node
    assert sweep[-2:] == ["--sweep", "/dev/shm"]
    assert f"checkpoint.dir={INJECTED_VALUE[:0]}'{INJECTED_VALUE}'" in argv  # verbatim, one argument
    # The rendezvous port comes from the job id: 15000 + 77 % 15000.
    assert "--rdzv-endpoint=node-a:15077" in argv and "--rdzv-id=77" in argv
    assert argv[-1] == f"hydra.run.dir={job_dir}/run"
    assert not list(tmp_path.glob("PWNED*")), "a quoted override ran a command"
    assert os.path.isdir(f"{job_dir}/run")


def test_local_script_hands_the_injection_to_python_as_one_argument(tmp_path):
    python = write_exe(tmp_path / "python", RECORDER)
    repo = tmp_path / "repo"
    repo.mkdir()
    text = render_case("local", job_dir=str(tmp_path / "job"), repo_dir=str(repo), python=str(python))
    script = tmp_path / "submit.sh"
    script.write_text(text["submit.sh"])
    out = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=_env(tmp_path, tmp_path), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    (argv,) = _calls(tmp_path, "python")
    assert argv[:3] == ["-m", "torch.distributed.run", "--standalone"]
    assert INJECTION in argv
    assert not list(tmp_path.glob("PWNED*")) and not list(repo.glob("PWNED*"))


@pytest.mark.parametrize("sig", ["USR1", "TERM"])
def test_preemption_saves_then_requeues(tmp_path, sig):
    """USR1 to the batch shell -> SIGTERM to the step (via scancel) -> step exits -> scontrol requeue.
    TERM (a pre-emption without the user signal: Slurm signals the batch shell and every step at
    once) -> the script does not signal the step again, waits for its save, then requeues."""
    job_dir = str(tmp_path / "job")
    text = render_case("slurm_pyxis", job_dir=job_dir)["training.sbatch"]
    script = tmp_path / "training.sbatch"
    script.write_text(text)
    # srun: a step that runs until SIGTERM, then exits as a trainer does after saving.
    # The trap goes first and the pid file appears whole (mv), so the test never signals too early.
    srun = """#!/usr/bin/env bash
trap 'echo saved > "$FAKE_LOG/saved"; exit 143' TERM
echo $$ > "$FAKE_LOG/srun.pid.tmp" && mv "$FAKE_LOG/srun.pid.tmp" "$FAKE_LOG/srun.pid"
while true; do sleep 0.05; done
"""
    # scancel returns only once the step has ended: the step ends while the trap still runs, the
    # case where the script must still report the step's own status.
    scancel = """#!/usr/bin/env bash
echo "$@" >> "$FAKE_LOG/scancel.calls"
pid=$(cat "$FAKE_LOG/srun.pid")
kill -TERM "$pid"
while kill -0 "$pid" 2>/dev/null && ! [ -e "$FAKE_LOG/saved" ]; do sleep 0.01; done
sleep 0.2
"""
    bin_dir = _fake_bin(tmp_path, extra={"srun": srun, "scancel": scancel, "scontrol": SCONTROL})
    env = _env(
        tmp_path,
        bin_dir,
        SLURM_JOB_ID="91",
        SLURM_JOB_NODELIST="node-a",
        SLURM_JOB_NUM_NODES="4",
        WANDB_API_KEY="from-the-submitting-shell",
    )
    proc = subprocess.Popen(
        ["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 20
    while not (tmp_path / "srun.pid").exists():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    if sig == "USR1":
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 delivers
    else:
        proc.send_signal(signal.SIGTERM)  # what a pre-emption sends the batch shell...
        time.sleep(0.3)
        os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGTERM)  # ...and every step
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 143, err  # the step's status
    assert (tmp_path / "saved").exists()
    if sig == "USR1":
        assert (tmp_path / "scancel.calls").read_text().split() == ["--signal=TERM", "91"]
    else:
        assert not (tmp_path / "scancel.calls").exists()  # the step got TERM from Slurm already
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "91"]


def test_sbatch_script_refuses_to_start_without_its_secret(tmp_path):
    text = render_case("slurm_pyxis", job_dir=str(tmp_path / "job"))["training.sbatch"]
    (tmp_path / "t.sbatch").write_text(text)
    bin_dir = _fake_bin(tmp_path, "srun", extra={"scontrol": SCONTROL})
    env = _env(tmp_path, bin_dir, SLURM_JOB_ID="5", SLURM_JOB_NODELIST="n", SLURM_JOB_NUM_NODES="4")
    env.pop("WANDB_API_KEY", None)
    out = subprocess.run(["bash", str(tmp_path / "t.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "set WANDB_API_KEY in the environment you submit from" in out.stderr
    assert not _calls(tmp_path, "srun")


def test_refused_config_exits_2_and_writes_nothing(tmp_path):
    jobs = tmp_path / "jobs"
    out = run_launcher(["cluster=slurm", *TINY, "parallelism.tp=3", f"cluster.jobs_dir={jobs}"], cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines and all(line.startswith(("error: ", "launcher: warning: ")) for line in lines), lines
    problems = [line for line in lines if line.startswith("error: ")]
    assert any("parallelism.tp=3" in line and "choose a tp that divides" in line for line in problems), lines
    assert out.stdout == "" and "Traceback" not in out.stderr
    assert not jobs.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, field",
    [
        (["cluster=k8s"], "container.image"),
        (["cluster=slurm", "container.runtime=docker", "container.image=x:1"], "container.runtime=docker"),
        (["cluster=slurm", "container.runtime=pyxis"], "container.image"),
        (["cluster=local", "cluster.chain=2"], "cluster.chain is a setting of cluster=slurm"),
        (["cluster=slurm", "cluster.time_limit=soon"], "cluster.time_limit"),
        (["cluster=slurm", "cluster.partition=a b"], "cluster.partition"),
        (["cluster=k8s", "container.image=x:1", "cluster.job_name=Train_1"], "cluster.job_name"),
        (["cluster=slurm", "trainer.no_such_key=1"], "trainer.no_such_key"),
        (["cluster=slurm", "cluster.nproc_per_node=8", "cluster.gpus_per_node=4"], "cluster.nproc_per_node=8"),
        (["cluster=slurm", "cluster.time_limit=2"], "cluster.signal_seconds=120"),
        (["cluster=slurm", "cluster.nodes=0"], "cluster.nodes=0"),
        (["cluster=slurm", "+cluster.secret_env.bad-name=x"], "cluster.secret_env.bad-name"),
        (["cluster=local", "container.runtime=pyxis", "container.image=x:1"], "container.runtime=pyxis"),
        (["cluster=slurm", "cluster.stages=[training,evaluate]"], "cluster.stages"),
        (["cluster=slurm", "+cluster.secret_env.HF_TOKEN=hf/token"], "cluster.secret_env.HF_TOKEN"),
        (
            ["cluster=k8s", "container.image=x:1", "+cluster.secret_env.HF_TOKEN=Bad Name"],
            "cluster.secret_env.HF_TOKEN",
        ),
    ],
)
def test_launcher_refusals_name_the_field(args, field):
    from launcher_scripts.plan import Refused, plan

    with pytest.raises(Refused) as refused:
        plan([*args, "model=debug", "data=synthetic"])
    assert any(field in p for p in refused.value.problems), refused.value.problems
    assert all("\n" not in p for p in refused.value.problems)


# sbatch --parsable: prints "<id>;<cluster>", ids 101, 102, ... in the order of submission.
SBATCH = (
    RECORDER
    + """calls = open(os.path.join(os.environ["FAKE_LOG"], "sbatch.jsonl")).read().splitlines()
print(f"{100 + len(calls)};cluster-a")
"""
)


def test_dry_run_writes_everything_and_submits_nothing(tmp_path):
    bin_dir = _fake_bin(tmp_path, extra={"sbatch": SBATCH})
    jobs = tmp_path / "jobs"
    args = [
        "cluster=slurm",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=0",
        *TINY,
        f"cluster.jobs_dir={jobs}",
        "cluster.chain=1",
    ]
    out = run_launcher([*args, "dry_run=true"], cwd=tmp_path, env=_fake_path(tmp_path, bin_dir))
    assert out.returncode == 0, out.stderr
    job_dir = Path(out.stdout.strip().splitlines()[-1])
    assert job_dir.parent == jobs
    names = {p.name for p in job_dir.iterdir()}
    assert names >= {"config.yaml", "training.sbatch", "submit.sh", "launcher.txt"}
    assert _calls(tmp_path, "sbatch") == []
    # config.yaml is the job's full config: it loads back into the same typed config.
    cfg = to_config(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(job_dir / "config.yaml")))
    assert (cfg.cluster.nproc_per_node, cfg.model.name, cfg.checkpoint.resume) == (2, "debug", "auto")
    # launcher.yaml is the launcher's own config: it loads back into the Slurm schema; config.yaml,
    # what main.py gets, holds nothing of it.
    launch = to_launcher_config(
        OmegaConf.merge(
            OmegaConf.structured(LauncherConfig(cluster=SlurmCluster())), OmegaConf.load(job_dir / "launcher.yaml")
        )
    )
    assert isinstance(launch.cluster, SlurmCluster) and launch.cluster.chain == 1 and launch.dry_run
    config_text = (job_dir / "config.yaml").read_text()
    assert "partition" not in config_text and "dry_run" not in config_text and "container" not in config_text

    # The same job, submitted: submit.sh calls sbatch for the job and its chained copy.
    out = run_launcher(args, cwd=tmp_path, env=_fake_path(tmp_path, bin_dir))
    assert out.returncode == 0, out.stderr
    job_dir = Path(out.stdout.strip().splitlines()[-1])
    calls = _calls(tmp_path, "sbatch")
    assert [c[-1] for c in calls] == [str(job_dir / "training.sbatch")] * 2
    assert calls[0][1] == "--dependency=singleton"
    assert calls[1][1] == "--dependency=afterany:101,singleton"  # the id without sbatch's ";cluster"
    assert (job_dir / "job_ids").read_text().split() == ["101", "102"]
    assert "training: 101" in out.stdout


def test_k8s_without_kubectl_writes_the_manifest_for_the_user(tmp_path):
    out = run_launcher(
        [
            "cluster=k8s",
            "container.image=registry.example/org/train:1.0",
            *TINY,
            "cluster.nproc_per_node=2",
            "cluster.gpus_per_node=0",
            f"cluster.jobs_dir={tmp_path}/jobs",
        ],
        cwd=tmp_path,
        env={"PATH": str(Path(sys.executable).parent)},
    )  # no kubectl there
    assert out.returncode == 0, out.stderr
    job_dir = Path(out.stdout.strip().splitlines()[-1])
    assert (job_dir / "pytorchjob.yaml").exists()
    assert "kubectl not found" in out.stderr and str(job_dir / "submit.sh") in out.stderr

    bin_dir = _fake_bin(tmp_path, "kubectl")
    out = run_launcher(
        [
            "cluster=k8s",
            "container.image=registry.example/org/train:1.0",
            *TINY,
            "cluster.nproc_per_node=2",
            "cluster.gpus_per_node=0",
            f"cluster.jobs_dir={tmp_path}/jobs",
        ],
        cwd=tmp_path,
        env=_fake_path(tmp_path, bin_dir),
    )
    job_dir = Path(out.stdout.strip().splitlines()[-1])
    assert _calls(tmp_path, "kubectl") == [["apply", "-f", str(job_dir / "pytorchjob.yaml")]]


def test_local_agents_stop_when_one_fails(tmp_path):
    """Two agents: the first to start fails at once; the other (stuck in its rendezvous) is stopped."""
    python = write_exe(
        tmp_path / "python",
        """#!/usr/bin/env bash
if mkdir "$FAKE_LOG/first" 2>/dev/null; then exit 3; fi
trap 'exit 143' TERM
for _ in $(seq 300); do sleep 0.1; done
""",
    )
    text = render_case("local_two_node", job_dir=str(tmp_path / "job"), repo_dir=str(tmp_path), python=str(python))[
        "submit.sh"
    ]
    (tmp_path / "submit.sh").write_text(text)
    started = time.time()
    out = subprocess.run(
        ["bash", str(tmp_path / "submit.sh")], env=_env(tmp_path, tmp_path), capture_output=True, text=True, timeout=25
    )
    assert out.returncode == 3, out.stderr
    assert "stopping the others" in out.stderr
    assert time.time() - started < 20


def test_the_launcher_never_imports_torch(tmp_path):
    """It validates with framework.config alone: a login node without torch can submit."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from launcher_scripts.plan import plan; "
        "plan(['cluster=slurm', 'model=debug', 'data=synthetic', 'cluster.gpus_per_node=0', "
        "'cluster.nproc_per_node=2', 'cluster.cpus_per_task=2']); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parents[2])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
