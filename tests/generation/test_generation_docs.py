"""docs/generation.md's speed table is the committed output of bench/generate.py, whose JSON says
the cached and recomputed tokens were the same."""

from __future__ import annotations

import json

from conftest import REPO


def test_the_speed_table_is_the_committed_bench_output():
    out = (REPO / "bench" / "results" / "generate.txt").read_text().strip().splitlines()
    table = [line for line in out if line.startswith("|")]
    doc = (REPO / "docs" / "generation.md").read_text()
    assert len(table) == 4 and "\n".join(table) in doc, table
    result = json.loads((REPO / "bench" / "results" / "generate.json").read_text())
    assert result["new_tokens"] == 128 and result["model"]["dim"] == 192  # model=small
    assert result["command"] in doc.replace(".venv/bin/python", "python")
    for row, line in zip(result["rows"], table[2:]):
        assert row["same_tokens"] and f"| {row['batch']} | {row['cached_cpu_s']:.3f} |" in line, (row, line)
        assert f"{row['speedup_cpu']:.2f}x" in line
