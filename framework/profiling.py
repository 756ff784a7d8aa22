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
    return _peak_of_records(prof.profiler.kineto_results)


# Names the profiler leaves out of its op list (torch.autograd.profiler_util._filter_name).
_NOT_OPS = {
    "[memory]",
    "[OutOfMemory]",
    "profiler::_record_function_enter",
    "profiler::_record_function_enter_new",
    "profiler::_record_function_exit",
    "aten::is_leaf",
    "aten::output_nr",
    "aten::_version",
}


class _Op:
    __slots__ = ("name", "start", "end", "thread", "inclusive", "sync", "linked", "parent", "children")

    def __init__(self, name, start, end, thread, inclusive, sync, linked):
        self.name, self.start, self.end, self.thread = name, start, end, thread
        self.inclusive, self.sync, self.linked = inclusive, sync, linked
        self.parent, self.children = None, []


def _peak_of_records(result) -> int:
    """The peak of a trace's CPU allocations, straight from the profiler's records.

    [Note: a step's peak from the profiler's records]
    The same number as summing, in time order, each op's `self_cpu_memory_usage` at its start and
    each allocation no op encloses at its own time (torch's `prof.events()` view), without building
    that view: ~1 s of Python per traced step on a 2-core machine, most of a memory-measuring
    test's time. What the view does is reproduced: an op takes every allocation record whose time
    lies in its closed interval, whatever the thread; its self usage is that minus its children's,
    children nesting by time on the op's thread (an op linked to a front-end op counts on that
    op's thread; asynchronous ops, gloo's collectives among them, nest and count nothing); a lone
    child named as its parent is folded into it; ties in time go to the smaller usage first.
    tests/unit/test_profiling.py checks the two agree on a step.
    """
    import bisect
    import itertools

    from torch.autograd import DeviceType

    events = list(result.events())
    cpu_kinds = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    records = sorted(
        (e.start_ns(), e.nbytes() if e.device_type() in cpu_kinds else 0) for e in events if e.name() == "[memory]"
    )
    times = [t for t, _ in records]
    prefix = [0, *itertools.accumulate(b for _, b in records)]
    covered = [False] * len(records)
    ops, frontend = [], {}
    for e in events:
        if e.name() in _NOT_OPS or getattr(e, "is_hidden_event", lambda: False)():
            continue
        if e.device_type() != DeviceType.CPU:
            continue
        start, end = e.start_ns(), e.end_ns()
        lo, hi = bisect.bisect_left(times, start), bisect.bisect_right(times, end)
        for i in range(lo, hi):
            covered[i] = True
        sync = not e.is_async() and e.start_thread_id() == e.end_thread_id()
        name = "ProfilerStep*" if e.name().startswith("ProfilerStep#") else e.name()
        op = _Op(name, start, end, e.start_thread_id(), prefix[hi] - prefix[lo], sync, e.linked_correlation_id())
        ops.append(op)
        if op.linked == 0 and sync:
            frontend[e.correlation_id()] = op
    for op in ops:  # an op linked to a front-end op is counted on that op's thread
        if op.linked > 0 and op.linked in frontend:
            op.thread = frontend[op.linked].thread
    synchronous = sorted((o for o in ops if o.sync), key=lambda o: o.thread)
    for _, group in itertools.groupby(synchronous, key=lambda o: o.thread):
        stack = []
        for op in sorted(group, key=lambda o: (o.start, -o.end)):
            while stack:
                parent = stack[-1]
                if op.start >= parent.end or op.end > parent.end:
                    stack.pop()
                else:
                    parent.children.append(op)
                    op.parent = parent
                    break
            stack.append(op)
    # a lone child named as its parent is folded into it (its children become the parent's)
    kept = ops
    while True:
        dropped = set()
        for op in kept:
            parent = op.parent
            if parent is not None and parent.name == op.name and len(parent.children) == 1:
                parent.children = op.children
                for child in op.children:
                    child.parent = parent
                dropped.add(id(op))
        if not dropped:
            break
        kept = [o for o in kept if id(o) not in dropped]
    base = result.trace_start_ns()
    items = []
    for o in kept:
        own = o.inclusive - sum(c.inclusive for c in o.children) if o.sync else 0
        if own:
            items.append(((o.start - base) / 1000, own))
    items += [((t - base) / 1000, b) for (t, b), c in zip(records, covered) if not c and b]
    cur = peak = 0
    for _, usage in sorted(items):
        cur += usage
        peak = max(peak, cur)
    return peak
