"""bench/memory_snapshots.py on the tiny GPT, one round: it trains with snapshots at interval 10,
restores the same state from memory and from a disk checkpoint (each asserted to come back at the
snapshot's step inside the script), and reports what the snapshots hold on the node: two
generations of both ranks' fp32 shards and AdamW moments (three fp32 values per parameter)."""

from __future__ import annotations

import argparse
import json


def test_bench_restores_the_same_step_from_memory_and_disk(tmp_path):
    from bench.common import gpt_params
    from bench.memory_snapshots import run

    out = run(argparse.Namespace(model_size="tiny", ranks=2, interval=10, rounds=1, out=str(tmp_path / "s.json")))
    assert out["restore_memory_s"] > 0 and out["restore_disk_s"] > 0 and out["copy_s"] > 0
    data = 2 * 3 * 4 * gpt_params("tiny")  # two generations x (param + exp_avg + exp_avg_sq) x fp32
    manifests = out["segment_bytes_per_node"] - data  # the manifests' JSON and AdamW's step counters
    assert 0 < manifests < 0.2 * data, out["segment_bytes_per_node"]
    json.dumps(out)  # what main() writes
