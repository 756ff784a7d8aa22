"""A pipeline whose middle stage stops (SIGSTOP: a rank stuck, its neighbours waiting in their
sends and receives) ends within trainer.collective_timeout_s + 30 s, naming the stopped rank, with
no process left. See [Note: naming the rank that did not arrive] in framework/runtime.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import REPO, TINY, rank_pids, read_metrics, start_main

TIMEOUT_S = 5  # trainer.collective_timeout_s: the least accepted (framework/config/schema.py)


def test_a_stopped_middle_stage_ends_the_job_naming_it(tmp_path):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = start_main(
        [
            *TINY,
            "parallelism.pp=3",  # stages 0, 1, 2 on ranks 0, 1, 2: rank 1 is the middle one
            "cluster.nproc_per_node=3",
            "model.args.n_layers=3",
            "trainer.micro_batch_size=2",
            "trainer.global_batch_size=8",
            "trainer.max_steps=100000",
            "trainer.eval_interval=0",
            "checkpoint.save_final=false",
            f"trainer.collective_timeout_s={TIMEOUT_S}",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        env=env,
    )
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 2):
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 3, subprocess.run(
            ["ps", "-o", "pid,ppid,args", "--ppid", str(proc.pid)], capture_output=True, text=True
        ).stdout
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 1, err[-3000:]
    assert "rank(s) 1 did not arrive: no sign of life" in err, err[-3000:]
    assert "stopped rank(s) 1" in err, err[-3000:]
    assert took < TIMEOUT_S + 30, (took, err[-3000:])
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
