"""The trainer's step without and with `trainer.deterministic` (bench/engine.py's rows ours_clip
and ours_det), interleaved step by step on 2 gloo ranks, in several runs; optionally each alone
for its RSS peak. Prints each run's per-step ratios and medians; writes a JSON.

    .venv/bin/python bench/deterministic_step.py --runs 3 --steps 6 --memory \\
        --out bench/results/deterministic_step.json

`--repo DIR` runs another checkout's engine with this script (e.g. the code before a change:
`git archive <commit> | tar -x -C DIR`), so two versions are compared by the same method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROWS = ("ours_clip", "ours_det")


def timing_worker(rank, ws, repo, size, steps):
    sys.path.insert(0, repo)
    from bench.engine import build, step

    built = {e: build(e, size) for e in ROWS}
    times = {e: [] for e in ROWS}
    for r in range(2 + steps):  # 2 warm-up steps; the order alternates step by step
        k = r % len(ROWS)
        for e in ROWS[k:] + ROWS[:k]:
            model, opt = built[e]
            t, _ = step(e, model, opt, size, r, rank)
            if r >= 2:
                times[e].append(t)
    return times


def memory_worker(rank, ws, repo, engine, size, steps):
    sys.path.insert(0, repo)
    from bench.engine import memory_worker as one

    return one(rank, ws, engine, size, steps)


def main() -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=here, help="the checkout whose engine runs (default: this one)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per run (after 2 warm-up)")
    ap.add_argument("--model-size", default="25m")
    ap.add_argument("--memory", action="store_true", help="also each row alone: its RSS peak (2 steps)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    repo = os.path.abspath(args.repo)
    sys.path.insert(0, repo)
    os.chdir(repo)
    from framework.local_ranks import run_local

    runs = []
    for i in range(args.runs):
        t = run_local(timing_worker, 2, args=(repo, args.model_size, args.steps), timeout_s=1800)[0]
        ratios = [d / c for c, d in zip(t["ours_clip"], t["ours_det"])]
        med = {e: statistics.median(t[e]) for e in ROWS}
        runs.append({"times": t, "median_s": med, "ratio_of_medians": med["ours_det"] / med["ours_clip"]})
        print(
            f"run {i + 1}: trainer step {med['ours_clip']:.3f} s, deterministic {med['ours_det']:.3f} s, "
            f"ratio {runs[-1]['ratio_of_medians']:.3f} (per step: {' '.join(f'{r:.2f}' for r in ratios)})",
            flush=True,
        )
    out = {"repo": repo, "model_size": args.model_size, "steps": args.steps, "runs": runs}
    out["median_ratio"] = statistics.median(r["ratio_of_medians"] for r in runs)
    print(f"median over runs of the deterministic/default interleaved ratio: {out['median_ratio']:.3f}")
    if args.memory:
        out["rss_peak_mb"] = {}
        for e in ROWS:
            res = run_local(memory_worker, 2, args=(repo, e, args.model_size, 2), timeout_s=900)
            out["rss_peak_mb"][e] = max(m["rss_peak_mb"] for m in res)
        print("RSS peak MB (the fuller rank, each row alone):", out["rss_peak_mb"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
