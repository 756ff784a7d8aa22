"""bench/engine_muon.py's bytes: on 2 gloo ranks, for each shard-boundary policy, a step's traffic
under AdamW and under Muon is the planner's figure (the script asserts it on every rank and step),
and Muon's extra bytes are its whole-matrix gather and reduce-scatter, made in the optimizer step
alone ([Note: whole matrices from pieces]): one unit shard each way per block under anywhere and
rows, none under params (every matrix whole on one rank)."""

from __future__ import annotations

import json


def test_muon_rows_bytes_equal_the_planners(tmp_path):
    from bench.engine_muon import BOUNDARIES, plan_job, run
    from framework.planner.estimate import layouts

    out = tmp_path / "muon.json"
    rows = run("tiny", 2, 1, BOUNDARIES, str(out), warmup=0)
    assert (
        json.loads(out.read_text())["rows"].keys()
        == rows.keys()
        == {f"{b} {o}" for b in BOUNDARIES for o in ("adamw", "muon")}
    )
    for boundary in BOUNDARIES:
        adamw, muon = rows[f"{boundary} adamw"], rows[f"{boundary} muon"]
        assert adamw["whole_matrix_mb_per_step"] == 0
        # the extra bytes of a Muon step are the optimizer step's: its whole matrices
        extra = muon["comm_mb_per_step"] - adamw["comm_mb_per_step"]
        assert muon["whole_matrix_mb_per_step"] == extra == muon["plan_whole_matrix_mb_per_step"]
        # written out: per block (the root's matrices lie on one rank here), (N - 1) x S fp32
        # elements gathered and as many reduce-scattered, S the block's shard
        lays = layouts(plan_job("tiny", 2, boundary, "muon"))
        S = lays[1].S
        want = 0 if boundary == "params" else 2 * (len(lays) - 1) * (2 - 1) * S * 4
        assert muon["whole_matrix_mb_per_step"] * 2**20 == want, (boundary, muon, S)
        assert (want > 0) == (boundary != "params")
