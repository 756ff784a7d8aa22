"""Every failure explained, faults survived: a rank that raises, hangs or is killed, two jobs on one
run directory, and a restart under torchrun that must resume exactly.

Faults are injected from outside the framework: `inject/sitecustomize.py` (on PYTHONPATH for these
runs only) makes one rank's loss computation raise or SIGKILL itself at a chosen step; a hang is a
real SIGSTOP. See [Note: every failure explained] in framework/runtime.py.

Each fault runs on every transport our engine can pick on this machine (`TRANSPORTS`): a failure
must end the job the same way whichever transport the rank was waiting in.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, main_env, rank_pids, read_metrics, run_main, start_main, torchrun

from framework.distributed.fsdp.host import HOST_TRANSPORTS, shm

INJECT = Path(__file__).resolve().parent / "inject"
SHORT = TINY + [
    "trainer.eval_interval=0",
    "trainer.max_steps=8",
    "optimizer.schedule=constant",
]
# The transports the native engine can pick for CPU ranks on this host (shared memory needs Linux on
# x86-64); torch's engine runs on gloo, as our gloo transport does.
TRANSPORTS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            name == "shm" and not shm.supported(), reason="the shm transport needs Linux on x86-64 with /dev/shm"
        ),
    )
    for name in HOST_TRANSPORTS
]


def _on(transport: str) -> list:
    """`gloo+float8`: float8 training, whose gather adds a MAX all-reduce of the scales per unit."""
    name, _, feature = transport.partition("+")
    return ["parallelism.engine=native", f"parallelism.host_transport={name}"] + (
        ["parallelism.float8=true"] if feature == "float8" else []
    )


def _env(fault: str = "") -> dict:
    return main_env({"PYTHONPATH": f"{INJECT}{os.pathsep}{REPO}", "FRAMEWORK_TEST_FAULT": fault})


def _torchrun(args, cwd, env, timeout=300, *extra):
    cmd = torchrun(["--nproc_per_node=2", *extra], args)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# Ranks forked (CPU builds) on every transport, and spawned (the GPU builds' start) on gloo: one
# transport is enough for that path.
STARTS = [pytest.param(*t.values, "fork", marks=t.marks) for t in TRANSPORTS] + [pytest.param("gloo", "spawn")]


@pytest.mark.parametrize("transport, start", STARTS)
def test_exception_in_one_rank_under_main_py_prints_its_traceback(tmp_path, transport, start):
    """On every transport, with the ranks forked (CPU builds) or spawned (CUDA builds): see
    [Note: local ranks are forked on CPU builds]."""
    env = {**_env("runtime:1:3"), "FRAMEWORK_RANK_START": start}
    out = run_main(SHORT + _on(transport) + [f"hydra.run.dir={tmp_path}/run"], tmp_path, env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    # Rank 1's own traceback (the injected error), under its rank number; rank 0's error (its peer
    # vanished mid-collective) is printed too, before it. Each once.
    assert "error: rank 1 (of 2) failed:" in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("RuntimeError: injected fault on rank 1 at call 3") == 1, out.stderr[-3000:]
    assert out.stderr.count("Traceback (most recent call last)") == 2, out.stderr[-3000:]
    assert out.stderr.index("rank 0 (of 2) failed") < out.stderr.index("rank 1 (of 2) failed")


@pytest.mark.parametrize(
    "fault, line",
    [
        ("kill:1:3", "error: rank 1 was killed by signal SIGKILL"),
        ("oserror:1:3", "OSError: [Errno 28] No space left on device (injected)"),
    ],
    ids=["dead_rank", "full_disk"],
)
def test_float8_job_ends_cleanly_on_a_dead_rank_and_a_full_disk(tmp_path, fault, line):
    """Float8 training's extra collective (the scales' all-reduce before each gather) fails like
    the others: a killed rank or an I/O error in one rank ends the job, named, with the crash status."""
    out = run_main(SHORT + _on("gloo+float8") + [f"hydra.run.dir={tmp_path}/run"], tmp_path, env=_env(fault))
    assert out.returncode == 1, out.stderr[-3000:]
    assert line in out.stderr and "rank 1" in out.stderr, out.stderr[-3000:]


def test_failure_report_orders_ranks_dedupes_and_names_signals(tmp_path, capsys):
    from framework.local_ranks import _print_failures

    class Proc:
        def __init__(self, exitcode):
            self.exitcode = exitcode

    same = "Traceback (most recent call last):\nRuntimeError: gloo: connection closed by peer\n"
    for rank in (0, 2):
        (tmp_path / f"rank_{rank}.txt").write_text(same)
    procs = [Proc(1), Proc(-signal.SIGKILL), Proc(1), Proc(-signal.SIGKILL)]
    _print_failures(procs, first=(1, -signal.SIGKILL), stopped=[3], report_dir=str(tmp_path))
    err = capsys.readouterr().err
    assert "error: rank 1 was killed by signal SIGKILL" in err, err
    assert err.count("connection closed by peer") == 1 and "error: ranks 0, 2 (of 4) failed:" in err, err
    assert "stopped rank(s) 3: still running 5 s after rank 1 ended" in err, err


@pytest.mark.parametrize("transport", [*TRANSPORTS, "gloo+float8"])
def test_hung_rank_ends_the_job_naming_it_and_nothing_is_left(tmp_path, transport):
    """SIGSTOP one rank: the other's next collective times out after trainer.collective_timeout_s
    (5 s here, 300 by default) on whichever transport it waits in, the job ends naming the stopped
    rank, and no process remains (the stopped one is killed with SIGKILL, which reaches it)."""
    run = tmp_path / "run"
    proc = start_main(
        [
            *TINY,
            "trainer.max_steps=100000",
            "trainer.eval_interval=0",
            "checkpoint.save_final=false",
            "trainer.collective_timeout_s=5",
            *_on(transport),
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        env=_env(),
    )
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, subprocess.run(
            ["ps", "-o", "pid,ppid,args", "--ppid", str(proc.pid)], capture_output=True, text=True
        ).stdout
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, err[-3000:]
    assert "rank(s) 1 did not arrive: no sign of life" in err, err[-3000:]
    assert "error: rank 0 (of 2) failed:" in err and "stopped rank(s) 1" in err, err[-3000:]
    assert took < 120
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid


def test_second_job_on_a_run_directory_refuses_in_one_line(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; sys.path.insert(0, sys.argv[1]); "
            "from framework.checkpoint.run_lock import lock_run_dir; lock_run_dir(sys.argv[2]); "
            "print('locked', flush=True); time.sleep(600)",
            str(REPO),
            str(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        out = run_main(TINY + ["trainer.max_steps=2", f"hydra.run.dir={run}"], tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"is in use by a running job (pid {holder.pid} on " in errors[0], out.stderr
        assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()
        # Under torchrun rank 0 is no parent of rank 1: the refusal still ends every rank with
        # status 2 (torchrun itself then exits 1, as it does for any failed worker).
        out = _torchrun(TINY + ["trainer.max_steps=2", f"hydra.run.dir={run}"], tmp_path, _env())
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "is in use by a running job" in errors[0], out.stderr[-3000:]
        # every rank that ended by itself ended with 2 (torchrun may stop the other first)
        assert re.findall(r"exitcode\s*: 2 ", out.stderr), out.stderr[-3000:]
        assert not re.findall(r"exitcode\s*: 1 ", out.stderr), out.stderr[-3000:]
        assert "Connection closed" not in out.stderr and "RuntimeError" not in out.stderr, out.stderr[-3000:]
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up (its pid is still in the file): the lock went with it.
    again = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); "
            "from framework.checkpoint.run_lock import lock_run_dir; lock_run_dir(sys.argv[2])",
            str(REPO),
            str(run),
        ],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0, again.stderr


def _losses(run: Path) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run) if "loss" in row}


RESTART = TINY + [
    "trainer.eval_interval=0",
    "trainer.max_steps=10",
    "checkpoint.interval=3",
    "checkpoint.resume=auto",
]
RESTART_TOLERANCE = 1e-6  # fp32 on CPU, gloo: a resume is bitwise in practice; 1e-6 as the issue asks


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rank_killed_or_raising_under_torchrun_restarts_and_resumes_exactly(tmp_path, transport):
    """Under torchrun --max-restarts=2 --rdzv-backend=c10d: rank 1 is SIGKILLed at step 5 (first
    attempt), then rank 0 raises an OSError at step 7 (second attempt). The OSError's traceback is
    printed with its rank; each time torchrun restarts the group, which resumes from the latest
    checkpoint (step 3, then step 6) and logs, for every later step, an uninterrupted run's losses.

    FRAMEWORK_TEST_RESTART_RUNS=5 (read when the test runs) repeats the faulty run that many times
    against the one reference: the "must work every time" check, too long for every suite run."""
    reference = run_main(RESTART + _on(transport) + [f"hydra.run.dir={tmp_path}/reference"], tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = _losses(tmp_path / "reference")
    for attempt in range(int(os.environ.get("FRAMEWORK_TEST_RESTART_RUNS", "1"))):
        run, where, agent = tmp_path / f"run{attempt}", [f"hydra.run.dir={tmp_path}/run{attempt}"], []
        if transport == "gloo":  # no hydra.run.dir: the ranks of every attempt take the one the rendezvous id names
            run, where, agent = (
                tmp_path / "outputs" / "torchrun" / f"restart{attempt}",
                [],
                [f"--rdzv-id=restart{attempt}"],
            )
        started = time.monotonic()
        out = _torchrun(
            RESTART + _on(transport) + where,
            tmp_path,
            _env("kill:1:5,oserror:0:4:1"),
            300,
            "--max-restarts=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            *agent,
        )
        err = out.stderr
        assert out.returncode == 0, (attempt, err[-4000:])
        assert "error: rank 0 (of 2) failed:" in err, (attempt, err[-4000:])
        assert "OSError: [Errno 28] No space left on device (injected)" in err, (attempt, err[-4000:])
        assert "resumed from" in err and "step_00000003 at step 3" in err and "step_00000006 at step 6" in err, (
            attempt,
            err[-4000:],
        )
        got = _losses(run)
        assert sorted(got) == list(range(1, 11)), (attempt, sorted(got))
        if transport == "gloo":  # the ranks of all three attempts shared that one directory
            names = sorted(p.name for p in (tmp_path / "outputs" / "torchrun").iterdir())
            assert names == sorted(f"restart{i}" for i in range(attempt + 1)), names
        worst = max(abs(got[step] - expected[step]) for step in range(4, 11))
        assert worst <= RESTART_TOLERANCE, (attempt, worst)
        print(
            f"restart run {attempt + 1}: finished in {time.monotonic() - started:.0f} s, "
            f"largest loss difference after the restarts {worst:.1e}"
        )


def test_a_refusal_on_another_node_is_said_in_that_nodes_log(tmp_path):
    """Two torchrun agents (two "nodes", one rank each, in their own working directories): bad
    input found by rank 1 only is one `error:` line in rank 1's node log, not a silent exit 2."""
    from framework.runtime import free_port

    port = free_port()
    agents = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        flags = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=refusal"]
        cmd = torchrun(flags, [*SHORT, "trainer.collective_timeout_s=20", f"hydra.run.dir={tmp_path}/run"])
        agents.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=_env("refuse:1:1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    errs = [a.communicate(timeout=240)[1] for a in agents]
    assert all(a.returncode != 0 for a in agents), errs
    mine = [line for line in errs[1].splitlines() if line.startswith("error:")]
    assert mine == ["error: injected refusal on rank 1"], errs[1][-3000:]


def test_two_nodes_on_default_data_settings_train_to_the_end(tmp_path):
    """Two torchrun agents ("nodes", one rank each) in their own working directories, with the
    default data (the stdlib corpus in the default, relative data.cache_dir): each node's cache is
    its own, so each node prepares it, and the job trains to the end on both."""
    from framework.runtime import free_port

    port = free_port()
    agents = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        flags = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=defaults"]
        args = [*[a for a in TINY if not a.startswith("data=")], "data.seq_len=64", "trainer.eval_interval=0"]
        cmd = torchrun(flags, [*args, "trainer.max_steps=3", f"hydra.run.dir={tmp_path}/run"])
        agents.append(
            subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    errs = [a.communicate(timeout=400)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
    for node in (0, 1):  # each node prepared its own copy under its own working directory
        assert list((tmp_path / f"node{node}" / "data_cache").glob("stdlib-*/stdlib.idx")), node
    assert "is not shared by every node" in errs[0], errs[0][-3000:]
    assert [row["step"] for row in read_metrics(tmp_path / "run") if "loss" in row] == [1, 2, 3]


def test_a_refused_config_is_said_in_every_nodes_log(tmp_path):
    """Two torchrun agents with a config every rank refuses: each node's log has the `error:` line
    (the first rank of each node says it), not only global rank 0's."""
    from framework.runtime import free_port

    port = free_port()
    agents = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        flags = ["--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}", "--rdzv-backend=static"]
        flags += ["--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd = torchrun(flags, [*SHORT, "+optimizer.lrr=1", f"hydra.run.dir={tmp_path}/run"])
        agents.append(
            subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    errs = [a.communicate(timeout=120)[1] for a in agents]
    for node, err in enumerate(errs):
        mine = [line for line in err.splitlines() if line.startswith("error:")]
        assert mine == [
            "error: optimizer.lrr: no such setting (a '+' adds keys the job would ignore); did you mean optimizer.lr?"
        ], (node, err[-3000:])
