"""The benchmarks start their ranks one way: `framework.local_ranks.run_local` (directly or through
bench/common.py's `spawn`), as `main.py` starts its own, so a benchmark's ranks get the same
process group, compute threads, device and failure report as a job's. No benchmark starts
processes of its own or joins a process group itself; a single-process world of torch's `fake`
backend (bench/simulate.py: no ranks are started) is the one exception."""

from __future__ import annotations

import ast

from conftest import REPO

STARTERS = {"Process", "spawn", "start_processes", "Pool"}  # process starters of (torch.)multiprocessing


def _own_starts(path) -> list:
    """Where the file at `path` starts processes or joins a process group itself."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(n and n.split(".")[-1] == "multiprocessing" for n in names):
                found.append(f"line {node.lineno}: imports multiprocessing")
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            backend = node.args[0] if node.args else None
            fake = isinstance(backend, ast.Constant) and backend.value == "fake"
            if name == "init_process_group" and not fake:
                found.append(f"line {node.lineno}: init_process_group")
            if name in STARTERS and "mp" == getattr(getattr(node.func, "value", None), "id", ""):
                found.append(f"line {node.lineno}: mp.{name}")
    return found


def test_every_benchmark_starts_its_ranks_with_run_local():
    files = sorted((REPO / "bench").glob("*.py"))
    assert len(files) > 10
    own = {p.name: found for p in files if (found := _own_starts(p))}
    assert not own, f"benchmarks starting ranks of their own (use framework.local_ranks.run_local): {own}"
    assert "run_local" in (REPO / "bench" / "optimizer_step.py").read_text()
