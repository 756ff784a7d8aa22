"""`trainer.profile=true`: torch.profiler traces of a few training steps, one per rank.

[Note: step profiles]
A schedule of `trainer.profile_wait` skipped steps, `profile_warmup` traced-but-discarded steps
and `profile_active` recorded ones (torch.profiler.schedule, once), starting at the first step of
this run. Each rank writes `<run dir>/profile/rank_<r>.pt.trace.json`: Chrome trace format, which
Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open. The engine's own labels name
the unit (`fsdp::all_gather(layers.3)`, `fsdp::reduce_scatter(...)`, `fsdp::wait`), so a trace
reads like FSDP2's. On a GPU the CUDA kernels are traced too, and a CUDA memory snapshot of the
recorded steps is written beside the trace (`rank_<r>.memory.pickle`, for pytorch.org/memory_viz).
"""

from __future__ import annotations

import os
import sys

import torch


class StepProfiler:
    """Start with the loop, `step()` after every training step, `close()` at the end (every rank)."""

    def __init__(
        self, enabled: bool, run_dir: str, rank: int, device: torch.device, wait: int, warmup: int, active: int
    ):
        self.prof = None
        if not enabled:
            return
        from torch.profiler import ProfilerActivity, profile, schedule

        self.dir = os.path.join(run_dir, "profile")
        os.makedirs(self.dir, exist_ok=True)
        self.rank, self.cuda = rank, device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.start()

    def _write(self, prof) -> None:
        from framework.fileio import written_by_path

        # torch writes by name: into a temporary of our own, renamed over the final name (never
        # through a link planted there)
        with written_by_path(os.path.join(self.dir, f"rank_{self.rank:05d}.pt.trace.json")) as path:
            prof.export_chrome_trace(path)
        if self.cuda:
            with written_by_path(os.path.join(self.dir, f"rank_{self.rank:05d}.memory.pickle")) as path:
                torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.rank == 0:
            print(
                f"profile of the traced steps written to {self.dir} (one trace per rank)", file=sys.stderr, flush=True
            )

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None


def peak_delta_bytes(fn, device: torch.device | None = None) -> int:
    """Highest net bytes allocated while `fn` runs: CUDA's allocator statistics on a GPU; on CPU
    the profiler's allocation events (ops' own allocations and frees outside ops, in time order).
    The planner's tests and the benchmarks measure a step's peak with it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    items = []
    for e in prof.events():
        usage = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if usage:
            items.append((e.time_range.start, usage))
    cur = peak = 0
    for _, usage in sorted(items):
        cur += usage
        peak = max(peak, cur)
    return peak
