"""`stage=generate` refuses what decoding cannot do, in one line and before loading any weights."""

from __future__ import annotations

from conftest import TINY, run_main


def test_sequence_parallel_is_refused_by_name(tmp_path):
    out = run_main(
        TINY
        + ["stage=generate", "cluster.nproc_per_node=2", "parallelism.tp=2", "parallelism.sequence_parallel=true"]
        + ['generate.prompts=["def add(a, b):"]', f"hydra.run.dir={tmp_path}/g"],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: stage=generate with parallelism.sequence_parallel=true: decoding feeds one token at a time, which "
        "cannot be split over the tp ranks; set parallelism.sequence_parallel=false (tp stays)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
