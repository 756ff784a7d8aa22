"""Each pipeline schedule's bubble, measured by the ranks' own timers at pp=4, beside the planner's
figure (framework/config/pipeline.py, `bubble_fraction`).

    .venv/bin/python bench/pipeline_bubble.py                # writes bench/results/pipeline_bubble.{json,txt}
    .venv/bin/python bench/pipeline_bubble.py --steps 1 --out /tmp/bubble.json

Four gloo ranks on the CPU, one per stage position (pp=4, no data parallelism), build the trainer's Pipeline
(framework/distributed/pipeline.py) for each schedule from the same Llama (model=debug widened:
8 blocks of dim 256, so one block's forward on a microbatch of 2 x 128 tokens is tens of
milliseconds, far above a send's or the schedule's own overhead) and run its forward and backward
on 8 microbatches: gpipe and 1f1b with 2 blocks per stage, interleaved_1f1b and zbv with 2 stages
of one block per rank. The schedules take turns, one step each per round, so each sees the same
load. Per rank and step:

  compute  the wall time inside the stage's forward and backward calls (F, the input half I, the
           weight half W, a whole backward B), timed around the stage's methods;
  blocked  the wall time inside the schedule's waits on its sends and receives;
  step     from a barrier to the end of the step (its loss all-reduced over the pipeline).

The bubble is the idle share of the step: 1 - compute / step, averaged over the ranks (the median
over steps). On a machine with fewer cores than ranks a rank's compute is not isolated (a rank
that computes may wait for a core, one that waits frees its core for another), so the blocked
share (time waiting for a neighbour's activation or gradient) is given beside it as a second
reading of the same idle time. See bench/RESULTS.md for a run and what it says.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PP, M = 4, 8
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zbv"]
MODEL = [
    "model=debug",
    "model.args.dim=256",
    "model.args.n_heads=4",
    "model.args.n_kv_heads=4",
    "model.args.ffn_dim=704",
    "model.args.n_layers=8",
    "data=synthetic",
    "data.seq_len=128",
    "trainer.micro_batch_size=2",
    f"trainer.global_batch_size={2 * M}",
    f"parallelism.pp={PP}",
    f"parallelism.pp_microbatches={M}",
    f"cluster.nproc_per_node={PP}",
]
EXTRA = {
    "gpipe": ["parallelism.pp_schedule=gpipe"],
    "1f1b": ["parallelism.pp_schedule=1f1b"],
    "interleaved_1f1b": ["parallelism.pp_schedule=interleaved_1f1b", "parallelism.pp_virtual_stages=2"],
    "zbv": ["parallelism.pp_schedule=zbv"],
}


KINDS = {"input": "I", "weight": "W", "full": "B"}  # the stage's backward kinds, as the table names them


class _Clock:
    """Wall seconds spent inside the wrapped calls, by label."""

    def __init__(self):
        self.spent: dict = {}

    def wrap(self, fn, label):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = label(*args, **kwargs) if callable(label) else label
                self.spent[key] = self.spent.get(key, 0.0) + time.perf_counter() - start

        return timed


def _build(schedule: str, world: int):
    import torch

    from framework.config import compose_config, to_config
    from framework.config.validate import parallel_dims_of
    from framework.distributed.parallel_dims import build_mesh
    from framework.distributed.pipeline import Pipeline
    from framework.models import family_of
    from framework.models.tasks import cross_entropy

    cfg = to_config(compose_config(MODEL + EXTRA[schedule]))
    dims = parallel_dims_of(cfg, world)
    family = family_of(cfg.model)
    model = family.build(cfg.model, "cpu")
    family.init_weights(model, 0)
    pipe = Pipeline(
        model,
        dims,
        build_mesh(dims, "cpu"),
        cfg,
        family,
        torch.device("cpu"),
        M,
        family.task(cfg.model),
        cross_entropy,
    )
    return cfg, pipe


def _rank(rank: int, world: int, device, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as schedules

    clock = _Clock()
    schedules._wait_batch_p2p = clock.wrap(schedules._wait_batch_p2p, "blocked")
    built = {}
    for name in SCHEDULES:
        cfg, pipe = _build(name, world)
        for stage in pipe.stages:
            stage.forward_one_chunk = clock.wrap(stage.forward_one_chunk, "F")
            stage.backward_maybe_with_nosync = clock.wrap(
                stage.backward_maybe_with_nosync, lambda kind, *a, **k: KINDS[kind]
            )
        built[name] = pipe
    g = torch.Generator().manual_seed(0)
    vocab, seq = cfg.model.args["vocab_size"], cfg.data.seq_len
    batches = [
        (torch.randint(0, vocab, (2, seq), generator=g), torch.randint(0, vocab, (2, seq), generator=g))
        for _ in range(M)
    ]
    out = {name: [] for name in SCHEDULES}
    for step in range(steps + 1):  # the first round warms up (allocations, the engine's first step)
        for name in SCHEDULES:
            pipe = built[name]
            for p in pipe.model.parameters():
                p.grad = None
            dist.barrier()
            clock.spent = {}
            start = time.perf_counter()
            pipe.train_batches(batches)
            wall = time.perf_counter() - start
            if step:
                out[name].append({"step_s": wall, **clock.spent})
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "pipeline_bubble.json"))
    args = parser.parse_args()

    from bench.common import spawn
    from framework.config.pipeline import PipelineSchedule, bubble_fraction, virtual_stages

    load = os.getloadavg()
    started = time.perf_counter()
    per_rank = spawn(_rank, PP, args=(args.steps,), timeout_s=3000)
    took = time.perf_counter() - started
    rows = []
    for name in SCHEDULES:
        sched = PipelineSchedule(name)
        planned = bubble_fraction(sched, PP, M, virtual_stages(sched, 2))
        idle, blocked, step_s, parts = [], [], [], {}
        for i in range(args.steps):
            recs = [per_rank[r][name][i] for r in range(PP)]
            compute = [sum(v for k, v in rec.items() if k in "FIWB") for rec in recs]
            idle.append(statistics.mean(1 - c / rec["step_s"] for c, rec in zip(compute, recs)))
            blocked.append(statistics.mean(rec.get("blocked", 0.0) / rec["step_s"] for rec in recs))
            step_s.append(max(rec["step_s"] for rec in recs))
            for k in "FIWB":
                parts.setdefault(k, []).append(statistics.mean(rec.get(k, 0.0) for rec in recs))
        rows.append(
            {
                "schedule": name,
                "planner_bubble": planned,
                "measured_bubble": statistics.median(idle),
                "blocked_share": statistics.median(blocked),
                "step_s": statistics.median(step_s),
                "compute_s_per_rank": {k: statistics.median(v) for k, v in parts.items() if max(v) > 0},
                "per_step_bubble": idle,
            }
        )
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    result = {
        "command": " ".join([".venv/bin/python", "bench/pipeline_bubble.py", *sys.argv[1:]]),
        "pp": PP,
        "microbatches": M,
        "model": MODEL,
        "steps": args.steps,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_at_start": load,
        "load_average_at_end": os.getloadavg(),
        "seconds": round(took, 1),
        "rows": rows,
    }
    lines = [
        f"$ {result['command']}",
        f"{cpu}, {os.cpu_count()} cores; load average {load[0]:.1f} at the start, "
        f"{result['load_average_at_end'][0]:.1f} at the end; {took:.0f} s",
        f"pp={PP}, {M} microbatches, median of {args.steps} steps (each the mean over the 4 ranks)",
        "",
        f"{'schedule':<18}{'planner':>9}{'measured':>10}{'blocked':>9}{'step (s)':>10}  compute per rank (s)",
    ]
    for r in rows:
        parts = " ".join(f"{k}={v:.2f}" for k, v in r["compute_s_per_rank"].items())
        lines.append(
            f"{r['schedule']:<18}{r['planner_bubble']:>9.3f}{r['measured_bubble']:>10.3f}"
            f"{r['blocked_share']:>9.3f}{r['step_s']:>10.2f}  {parts}"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
