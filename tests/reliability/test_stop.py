"""Stopping is not checkpointing: the time limit and SIGTERM stop a run with the requeue status
(75) with checkpoints off as well (framework/stop.py), and the ranks stop after the same step."""

from __future__ import annotations

import os
import signal
import time

from conftest import TINY, rank_pids, read_metrics, run_main, start_main

from framework.errors import EXIT_REQUEUE

NO_CHECKPOINTS = ["checkpoint.interval=0", "checkpoint.save_final=false"]


def test_time_limit_stops_without_checkpoints(tmp_path):
    # The documented command: 0.05 minutes = 3 s of training, then status 75, nothing saved.
    out = run_main(
        TINY
        + NO_CHECKPOINTS
        + ["trainer.max_time_minutes=0.05", "trainer.max_steps=100000", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert out.returncode == EXIT_REQUEUE, out.stderr[-3000:]
    assert "trainer.max_time_minutes=0.05 reached): no checkpoint (checkpointing is off)" in out.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
    steps = [row["step"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert steps and steps == list(range(1, len(steps) + 1)) and len(steps) < 100000


def test_sigterm_to_one_rank_stops_every_rank_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    proc = start_main([*TINY, *NO_CHECKPOINTS, "trainer.max_steps=100000", f"hydra.run.dir={run}"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGTERM)  # one rank only: the other learns it in the step's all-reduce
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE, err[-3000:]
    assert "rank 1: received SIGTERM" in err and "(a signal on another rank): no checkpoint" in err, err[-3000:]
    assert not (run / "checkpoints").exists()
