"""Host memory for in-memory snapshots (checkpoint.memory_interval): the planner's count per node
(own + peer copies, two generations, the host buffers and the exchange's), equal to what two ranks
allocate, its refusal, and the check against memory_dir's free space."""

from __future__ import annotations

import os

from framework.checkpoint.snapshot_files import fit_problem
from framework.config import compose_config, to_config
from framework.planner.plan import fit_problems, make_plan
from framework.planner.snapshot_fit import planned_snapshots
from framework.planner.snapshots import snapshot_memory, snapshot_problem


def _cfg(*overrides):
    return to_config(compose_config(list(overrides)))


def test_snapshot_memory_per_node_is_own_plus_peer_copies_in_two_generations_plus_host_buffers():
    args = ["model=llama_70b", "cluster.nproc_per_node=8", "cluster.gpus_per_node=8", "checkpoint.memory_interval=10"]
    one = make_plan(_cfg(*args, "cluster.nodes=16"))
    est = one.estimate
    rope = 4096 * 128 * 4  # llama_70b's rotary table (max_seq_len x head_dim, fp32), whole on every rank
    assert est.job.model.buffer_bytes == rope
    per_rank = est.memory.params + est.memory.optimizer + rope
    # fp32 shards + AdamW's two moments (and its per-tensor step counters: a few hundred bytes)
    assert 0 <= per_rank - rope - 3 * est.memory.params < 1e-6 * per_rank
    snap = snapshot_memory(est)
    assert snap.per_rank == per_rank
    assert (snap.own, snap.peers) == (2 * 8 * per_rank, 2 * 8 * per_rank)  # memory_dir: two generations
    assert (snap.copies, snap.exchange) == (8 * per_rank, 2 * 8 * per_rank)  # the ranks' own buffers
    assert snap.per_node == 7 * 8 * per_rank
    assert any(note.startswith("in-memory snapshots every 10 steps: ") for note in one.notes), one.notes
    # one node keeps no copies for another, and exchanges none
    alone = snapshot_memory(make_plan(_cfg(*args, "cluster.nodes=1")).estimate)
    assert (alone.peers, alone.exchange) == (0, 0) and alone.per_node == 3 * 8 * alone.per_rank


def test_a_memory_interval_that_does_not_fit_host_memory_is_refused():
    # llama_1b on this machine's CPU nodes (24 GiB each), 2 ranks a node: over 2 nodes the job fits,
    # but each node keeps 2 generations of its ranks' shards and moments (13.8 GiB), as much of the
    # other node's, the ranks' host buffers (6.9) and the exchange's send and receive buffers
    # (13.8): 48.4 GiB, refused; over 4 nodes still 24.2 GiB, refused; over 8, 12.1 GiB: fits
    args = ["model=llama_1b", "cluster.nproc_per_node=2", "cluster.gpus_per_node=0", "checkpoint.memory_interval=10"]
    small = make_plan(_cfg(*args, "cluster.nodes=2")).estimate
    assert small.fits
    problem = snapshot_problem(10, small)
    assert problem == (
        "checkpoint.memory_interval=10: in-memory snapshots need 48.4 GiB of host memory per node (own 13.8 + "
        "peer copies 13.8 + host buffers 6.9 + exchange 13.8; 2 generations in memory_dir), more than the node's "
        "24 GiB; set checkpoint.memory_interval=0, or shard over more nodes"
    )
    assert snapshot_problem(0, small) is None  # off: nothing to refuse
    assert fit_problems(_cfg(*args, "cluster.nodes=2")) == [problem]  # the launcher refuses it
    assert snapshot_problem(10, make_plan(_cfg(*args, "cluster.nodes=4")).estimate) is not None
    big = make_plan(_cfg(*args, "cluster.nodes=8")).estimate
    assert snapshot_problem(10, big) is None and fit_problems(_cfg(*args, "cluster.nodes=8")) == []
    # what a starting job gets (framework/checkpoint/memory.py refuses with the line, and checks
    # memory_dir's free space for the rank's own generations)
    assert planned_snapshots(_cfg(*args, "cluster.nodes=2"), 4) == (problem, 2 * snapshot_memory(small).per_rank)
    assert planned_snapshots(_cfg(*args, "cluster.nodes=8"), 16)[0] is None


def test_snapshots_larger_than_the_free_space_of_memory_dir_are_refused(tmp_path):
    fs = os.statvfs(tmp_path)
    free = fs.f_bavail * fs.f_frsize
    assert fit_problem(5, 1 << 20, str(tmp_path), "fwsnap-u0-jabc-c1.2") is None
    line = fit_problem(5, free + (1 << 40), str(tmp_path), "fwsnap-u0-jabc-c1.2")
    assert line.startswith("checkpoint.memory_interval=5: the snapshots need ") and str(tmp_path) in line, line
    assert line.endswith("give checkpoint.memory_dir a larger tmpfs, or set checkpoint.memory_interval=0")


def test_the_planned_snapshot_memory_is_what_the_ranks_allocate(tmp_path):
    """Two torchrun agents stand for two nodes (one rank each), snapshots every 5 steps, 20 steps.
    tests/reliability/inject counts in each rank every tensor the snapshot code makes
    (the host buffers a snapshot is copied into, the exchange's send and receive buffers) while it
    lives, and the bytes of the `.data` files in each node's memory_dir: the peaks equal the
    planner's count for the same job, byte for byte (the manifests, a few KB of JSON, are not
    counted on either side)."""
    import json
    import subprocess
    from pathlib import Path

    from conftest import REPO, TINY, free_port, main_env, torchrun

    inject = REPO / "tests" / "reliability" / "inject"
    args = TINY + ["trainer.eval_interval=0", "checkpoint.memory_interval=5", "trainer.max_steps=20"]
    port, agents, dirs, measured = free_port(), [], [], []
    for node in (0, 1):
        shm, out, cwd = (tmp_path / f"{kind}{node}" for kind in ("shm", "measured", "node"))
        for d in (shm, out, cwd):
            d.mkdir()
        dirs.append(shm)
        measured.append(out)
        flags = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
        flags += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=measure"]
        cmd = torchrun(flags, [*args, f"checkpoint.memory_dir={shm}", f"hydra.run.dir={tmp_path}/run"])
        measure_env = {"FRAMEWORK_TEST_SNAPSHOT_DIR": str(shm), "FRAMEWORK_TEST_MEASURE_SNAPSHOTS": str(out)}
        env = main_env({"PYTHONPATH": f"{inject}{os.pathsep}{REPO}", **measure_env})
        agents.append(
            subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    errs = [a.communicate(timeout=300)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], [e[-3000:] for e in errs]
    peaks = [json.loads(Path(out / f"rank{rank}.json").read_text()) for rank, out in enumerate(measured)]

    snap = snapshot_memory(make_plan(_cfg(*args, "cluster.nodes=2", "cluster.nproc_per_node=1"), 2).estimate)
    assert snap.exchange and snap.peers  # two nodes: copies for the other node, and their exchange
    for peak in peaks:  # one rank per node: the node's count is the rank's
        assert peak["tensors"] == snap.copies + snap.exchange, (peak, snap)
        assert peak["memory_dir"] == snap.own + snap.peers, (peak, snap)
