"""Ranks restarted by torchrun meet under keys every rank of the attempt agrees on, even when the
agents' restart counts differ: see framework/runtime.py, [Note: one store, many attempts]."""

from __future__ import annotations

import subprocess

from conftest import free_port, main_env, torchrun

# Node 1's rank fails on its first attempt while node 0's stays healthy (asleep): under c10d, node
# 1's agent counts a restart and node 0's restarts its rank as a membership change, uncounted.
WORKER = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
from framework import runtime
marks, rank = pathlib.Path(sys.argv[1]), int(os.environ["RANK"])
runtime.init_distributed("cpu", collective_timeout_s=20)
dist.barrier()
first = not (marks / f"ran{rank}").exists()
(marks / f"ran{rank}").touch()
print(f"rank {rank} restart count {os.environ['TORCHELASTIC_RESTART_COUNT']} met in {runtime.attempt()}", flush=True)
if first:
    if rank == 1:
        sys.exit(3)
    time.sleep(60)
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {rank} summed {total.item():.0f}", flush=True)
runtime.shutdown()
"""


def test_ranks_restarted_by_c10d_agents_whose_restart_counts_differ_meet_at_once(tmp_path):
    script = tmp_path.joinpath("worker").with_suffix(".py")
    script.write_text(WORKER)
    env = main_env()
    port, agents = free_port(), []
    for _ in (0, 1):
        flags = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=generations", "--monitor-interval=1"]
        cmd = torchrun(flags, [str(tmp_path)], script=script)
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [a.communicate(timeout=240) for a in agents]
    logs = [out + err for out, err in outs]
    assert [a.returncode for a in agents] == [0, 0], [log[-3000:] for log in logs]
    met = sorted(line for log in logs for line in log.splitlines() if " met in " in line)
    # The rendezvous node order is not fixed: find the node of each rank by its lines.
    assert met == [
        "rank 0 restart count 0 met in generation_1",
        "rank 0 restart count 0 met in generation_2",
        "rank 1 restart count 0 met in generation_1",
        "rank 1 restart count 1 met in generation_2",
    ], met
    # Node 0's restarted rank met rank 1 at its first try: it never failed.
    node0 = next(log for log in logs if "rank 0 summed 2" in log)
    assert "failed (exitcode" not in node0, node0[-3000:]
    assert "rank 1 summed 2" in "".join(logs)
