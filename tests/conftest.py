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

# Small, fast settings shared by the end-to-end tests: the tiny model on synthetic data.
TINY = [
    "model=debug",
    "data=synthetic",
    "trainer.progress_bar=false",
    "logging.tensorboard=false",
    "trainer.sample_tokens=0",
]


def run_main(args: List[str], cwd: Path, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`python main.py args...` in `cwd`, capturing output; never hangs the suite."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(run_dir: Path) -> List[dict]:
    with open(run_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture
def repo() -> Path:
    return REPO
