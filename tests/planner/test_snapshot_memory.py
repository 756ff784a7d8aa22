"""Host memory for in-memory snapshots (checkpoint.memory_interval): the planner's count per node
(own + peer copies, two generations), its refusal, and the check against memory_dir's free space."""

from __future__ import annotations

import os

from framework.checkpoint.memory import fit_problem
from framework.config import compose_config, to_config
from framework.planner.plan import fit_problems, make_plan
from framework.planner.snapshot_fit import planned_snapshots
from framework.planner.snapshots import snapshot_memory, snapshot_problem


def _cfg(*overrides):
    return to_config(compose_config(list(overrides)))


def test_snapshot_memory_per_node_is_own_plus_peer_copies_in_two_generations():
    args = ["model=llama_70b", "cluster.nproc_per_node=8", "cluster.gpus_per_node=8", "checkpoint.memory_interval=10"]
    one = make_plan(_cfg(*args, "cluster.nodes=16"))
    est = one.estimate
    per_rank = est.memory.params + est.memory.optimizer
    # fp32 shards + AdamW's two moments (and its per-tensor step counters: a few hundred bytes)
    assert 0 <= per_rank - 3 * est.memory.params < 1e-6 * per_rank
    snap = snapshot_memory(est)
    assert (snap.own, snap.peers) == (2 * 8 * per_rank, 2 * 8 * per_rank)
    assert any(note.startswith("in-memory snapshots every 10 steps: ") for note in one.notes), one.notes
    # one node keeps no copies for another
    alone = snapshot_memory(make_plan(_cfg(*args, "cluster.nodes=1")).estimate)
    assert alone.peers == 0


def test_a_memory_interval_that_does_not_fit_host_memory_is_refused():
    # llama_1b on this machine's CPU nodes (24 GiB each), 2 ranks a node: over 2 nodes the job fits,
    # but each node keeps 2 generations of its ranks' shards and moments (13.8 GiB) and as much of
    # the other node's (27.6 GiB in all): refused; over 4 nodes, 13.8 GiB: fits
    args = ["model=llama_1b", "cluster.nproc_per_node=2", "cluster.gpus_per_node=0", "checkpoint.memory_interval=10"]
    small = make_plan(_cfg(*args, "cluster.nodes=2")).estimate
    assert small.fits
    problem = snapshot_problem(10, small)
    assert problem == (
        "checkpoint.memory_interval=10: in-memory snapshots need 27.6 GiB of host memory per node (own 13.8 + "
        "peer copies 13.8, 2 generations), more than the node's 24 GiB; set checkpoint.memory_interval=0, or "
        "shard over more nodes"
    )
    assert snapshot_problem(0, small) is None  # off: nothing to refuse
    assert fit_problems(_cfg(*args, "cluster.nodes=2")) == [problem]  # the launcher refuses it
    big = make_plan(_cfg(*args, "cluster.nodes=4")).estimate
    assert snapshot_problem(10, big) is None and fit_problems(_cfg(*args, "cluster.nodes=4")) == []
    # what a starting job gets (framework/checkpoint/memory.py refuses with the line)
    assert planned_snapshots(_cfg(*args, "cluster.nodes=2"), 4) == (problem, 2 * snapshot_memory(small).per_rank)
    assert planned_snapshots(_cfg(*args, "cluster.nodes=4"), 8)[0] is None


def test_snapshots_larger_than_the_free_space_of_memory_dir_are_refused(tmp_path):
    fs = os.statvfs(tmp_path)
    free = fs.f_bavail * fs.f_frsize
    assert fit_problem(5, 1 << 20, str(tmp_path), "fwsnap-u0-jabc-c1.2") is None
    line = fit_problem(5, free + (1 << 40), str(tmp_path), "fwsnap-u0-jabc-c1.2")
    assert line.startswith("checkpoint.memory_interval=5: the snapshots need ") and str(tmp_path) in line, line
    assert line.endswith("give checkpoint.memory_dir a larger tmpfs, or set checkpoint.memory_interval=0")
