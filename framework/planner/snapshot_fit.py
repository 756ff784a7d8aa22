"""The planner's word on a job's in-memory snapshots, for the job about to start (the trainer gives
it to framework/checkpoint/memory.py, which sits beside the planner and cannot import it)."""

from __future__ import annotations

from framework.planner.plan import make_plan
from framework.planner.snapshots import GENERATIONS, snapshot_memory, snapshot_problem


def planned_snapshots(cfg, world_size: int) -> tuple[str | None, int | None]:
    """The planner's refusal line (None when the snapshots fit the node's host memory), and one
    rank's own snapshot bytes in checkpoint.memory_dir, every generation (None when the planner
    cannot model the job: then only the free space of checkpoint.memory_dir is checked)."""
    try:
        est = make_plan(cfg, world_size).estimate
    except Exception:  # noqa: BLE001 - a job the planner cannot model is not refused for it
        return None, None
    return snapshot_problem(cfg.checkpoint.memory_interval, est), GENERATIONS * snapshot_memory(est).per_rank
