"""bench/engine_muon.py's bytes: on 2 gloo ranks, for each shard-boundary policy, a step's traffic
under AdamW and under Muon is the planner's figure (the script asserts it on every rank and step),
and Muon's extra bytes are its whole matrices' all-to-alls, made in the optimizer step alone
([Note: whole matrices from pieces]): each matrix's pieces to its owner and back, fewer than the
whole fp32 unit shard each way per block that gathering every unit with a crossing matrix moved."""

from __future__ import annotations

import json


def test_muon_rows_bytes_equal_the_planners(tmp_path):
    from bench.engine_muon import BOUNDARIES, plan_job, run
    from framework.distributed.shard_layout import granule, pack
    from framework.distributed.whole_owners import assign_owners, holdings, newton_schulz_flops
    from framework.planner.estimate import layouts, muon_tensors

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
        # written out: on 2 ranks each matrix's piece away from its owner goes there and back (what
        # either rank sends: the two are equal), fp32; the owners balanced over the whole model
        lays = layouts(plan_job("tiny", 2, boundary, "muon"))
        held, costs = [], []
        for lay in lays:
            offsets, S = pack([(t.numel, granule(t.numel, t.row, boundary)) for t in lay.unit.tensors], 2)
            for o, t, h in zip(offsets, lay.unit.tensors, muon_tensors(lay)):
                if h:
                    held.append(holdings(o, t.numel, S, 2))
                    costs.append(newton_schulz_flops((t.numel // t.row, t.row)))
        owners = assign_owners(costs, held, 2)
        want = sum(n * 4 for h, o in zip(held, owners) for r, n in h.items() if r != o)
        assert muon["whole_matrix_mb_per_step"] * 2**20 == want, (boundary, muon)
        # less than gathering and reduce-scattering the fp32 shard of every block holding a
        # crossing matrix, (N - 1) x S x 4 each way per block, as before the owners were balanced
        if boundary != "params":
            assert 0 < want < 2 * (len(lays) - 1) * (2 - 1) * lays[1].S * 4, (boundary, want)
