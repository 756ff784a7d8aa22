"""`bench/gpu_check.sh`, the one command that runs the GPU paths: without a GPU it refuses in one
line and writes nothing; the script itself is shellcheck-clean (the pinned shellcheck)."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import REPO, pinned_tool

GPU_CHECK = REPO / "bench" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run bench/gpu_check.sh itself")
def test_gpu_check_refuses_without_gpu(tmp_path):
    report = tmp_path / "report.txt"
    p = subprocess.run(
        ["bash", str(GPU_CHECK), str(report)], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bench/gpu_check.sh needs a CUDA GPU"), p.stderr
    assert not report.exists()  # nothing half-written


def test_gpu_check_is_shellcheck_clean():
    p = subprocess.run(
        [pinned_tool("shellcheck"), str(GPU_CHECK)], check=False, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stdout
