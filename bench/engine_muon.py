"""Muon vs AdamW on our engine, per shard-boundary policy: step time and bytes on the wire per step,
the whole-matrix traffic beside the planner's figure for it.

    .venv/bin/python bench/engine_muon.py                    # ~25M GPT, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/engine_muon.py --model-size tiny --steps 2 --out /tmp/muon.json
    .venv/bin/python bench/engine.py --muon                  # the same rows after the engine table

The benchmark GPT (bench/common.py) under our engine, every block one unit and the root kept
gathered, once per (policy, optimizer): shard_boundary anywhere | rows | params, each with AdamW
and with optimizer=muon as the trainer builds them (`framework.optim.build_optimizer`: Muon on
`hidden_matrix_names`, AdamW on the rest). All six step interleaved in one 2-rank group (round r
runs one step of each, in rotating order, after a barrier), so background load hits them alike;
medians of the slower rank. The timings come from a shared machine unless the output says
otherwise: read the ratios, not the seconds.

Bytes are exact, not timed: `comm_stats()` over a whole step (gathers, reductions) and over the
optimizer step alone (Muon's whole matrices to their owners and back, two all-to-alls: [Note: whole
matrices from pieces]), and beside them the planner's traffic (`framework.planner.estimate.traffic`) for a job
whose units are this model's (its parameters in the engine's order, Muon's marked by the builder's
rule: framework/param_roles.py). The script asserts the two are equal, per rank, step and policy.
Writes a table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import SIZES, batch, build_engine, build_gpt, loss_of  # noqa: E402
from framework.local_ranks import run_local  # noqa: E402

BOUNDARIES = ("anywhere", "rows", "params")
OPTIMIZERS = ("adamw", "muon")
LR = 1e-4  # AdamW's lr and Muon's: small, so 10 steps of random tokens stay far from overflow


def plan_job(size: str, world: int, boundary: str, optimizer: str):
    """The planner's job for this benchmark: a `ModelShape` whose units are the GPT's as
    `build_engine` shards it (the root: embedding (tied head), position table, final norm; then
    one unit per block), each tensor marked Muon's or not by the optimizer builder's rule."""
    from framework.models.shapes import ModelShape, Tensor, Unit
    from framework.param_roles import hidden_matrix_names
    from framework.planner.devices import DEVICES
    from framework.planner.estimate import Job

    vocab, d, layers, heads, seq, mb = SIZES[size]
    with torch.device("meta"):
        model = build_gpt(size)
    hidden = hidden_matrix_names(model)
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set = set()

    def tensors(module) -> tuple:
        out = []
        for p in module.parameters():  # a unit's own: what a unit below it took is skipped
            if id(p) not in seen:
                seen.add(id(p))
                row = p[0].numel() if p.dim() >= 2 else 1
                out.append(Tensor(names[id(p)], p.numel(), False, row=row, muon=names[id(p)] in hidden))
        return tuple(out)

    blocks = [Unit(f"blocks.{i}", tensors(b)) for i, b in enumerate(model.blocks)]
    units = [Unit("root", tensors(model))] + blocks
    shape = ModelShape(vocab, d, layers, heads, heads, 4 * d, lambda _shape, _tp: units, tie_embeddings=True)
    return Job(
        model=shape,
        seq_len=seq,
        micro_batch=mb,
        global_batch=mb * world,
        strategy="full",
        dp_replicate=1,
        dp_shard=world,
        tp=1,
        nodes=1,
        nproc_per_node=world,
        device=DEVICES["cpu"],
        optimizer=optimizer,
        shard_boundary=boundary,
        host_shm=True,
    )


def theory(size: str, world: int, boundary: str, optimizer: str, rank: int = 0) -> dict:
    """The planner's bytes per step on `rank`, in `comm_stats()`'s keys."""
    from framework.planner.estimate import traffic

    return traffic(plan_job(size, world, boundary, optimizer), rank=rank).engine_counters()


def _build(size: str, boundary: str, optimizer: str):
    from framework.config.schema import OptimizerConfig
    from framework.optim import build_optimizer, hidden_matrix_names

    engine = "ours" if boundary == "anywhere" else f"ours_{boundary}"
    model = build_engine(engine, size, torch.device("cpu"), dist.get_world_size()).model
    hidden = hidden_matrix_names(build_gpt(size))  # the model as built: its names
    cfg = OptimizerConfig(name=optimizer, lr=LR, muon_lr=LR, weight_decay=0.0)
    return model, build_optimizer(model, cfg, hidden=hidden)


KEYS = ("allgather_bytes", "reduce_scatter_bytes", "allreduce_bytes", "alltoall_bytes")


def _bytes(stats: dict) -> int:
    return sum(stats[k] for k in KEYS)


def worker(rank: int, world: int, size: str, steps: int, warmup: int, boundaries: list) -> dict:
    from framework.distributed.fsdp import set_host_transport

    torch.set_num_threads(1)
    set_host_transport("shm")
    rows = [(b, o) for b in boundaries for o in OPTIMIZERS]
    built = {r: _build(size, *r) for r in rows}
    out = {
        f"{b} {o}": {"step_s": [], "opt_s": [], "comm": [], "opt_comm": [], "step_bytes": [], "opt_bytes": []}
        for b, o in rows
    }
    for s in range(warmup + steps):
        k = s % len(rows)
        for row in rows[k:] + rows[:k]:
            model, opt = built[row]
            idx = batch(size, s, rank, "cpu")
            model.reset_comm_stats()
            dist.barrier()
            t0 = time.perf_counter()
            loss_of(model(idx[:, :-1]), idx).backward()
            before = model.comm_stats()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            after = model.comm_stats()
            if s >= warmup:
                rec = out[f"{row[0]} {row[1]}"]
                rec["step_s"].append(t2 - t0)
                rec["opt_s"].append(t2 - t1)
                rec["step_bytes"].append(_bytes(after))
                rec["opt_bytes"].append(_bytes(after) - _bytes(before))
                rec["comm"].append({k: after[k] for k in KEYS})
    return out


def _slowest(res: list, key: str, field: str) -> list:
    """Each step's time on the slower rank."""
    return [max(r[key][field][i] for r in res) for i in range(len(res[0][key][field]))]


def run(size: str, ranks: int, steps: int, boundaries, out_path: str, warmup: int = 2) -> dict:
    t0, load0 = time.time(), os.getloadavg()[0]
    res = run_local(worker, ranks, args=(size, steps, warmup, list(boundaries)), timeout_s=1800)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    rows = {}
    for key in res[0]:
        boundary, optimizer = key.split()
        for rank, r in enumerate(res):  # bytes are exact: every step of every rank, equal to the plan
            plan = theory(size, ranks, boundary, optimizer, rank)
            plan_whole = _bytes(plan) - _bytes(theory(size, ranks, boundary, "adamw", rank))
            for i in range(steps):
                got = r[key]["comm"][i]
                want = {k: plan[k] for k in got}
                assert got == want, f"{key}, rank {rank}, step {i}: measured {got}, the planner's {want}"
                assert r[key]["opt_bytes"][i] == plan_whole, (key, rank, i, r[key]["opt_bytes"][i], plan_whole)
        rows[key] = {
            "shard_boundary": boundary,
            "optimizer": optimizer,
            "median_step_s": statistics.median(_slowest(res, key, "step_s")),
            "median_opt_step_s": statistics.median(_slowest(res, key, "opt_s")),
            "comm_mb_per_step": res[0][key]["step_bytes"][0] / 2**20,
            "plan_comm_mb_per_step": _bytes(theory(size, ranks, boundary, optimizer)) / 2**20,
            "whole_matrix_mb_per_step": res[0][key]["opt_bytes"][0] / 2**20,
            "plan_whole_matrix_mb_per_step": (
                _bytes(theory(size, ranks, boundary, optimizer)) - _bytes(theory(size, ranks, boundary, "adamw"))
            )
            / 2**20,
            "comm_bytes": res[0][key]["comm"][0],
        }
    for row in rows.values():
        adamw = rows[f"{row['shard_boundary']} adamw"]
        row["step_ratio_to_adamw"] = row["median_step_s"] / adamw["median_step_s"]
    vocab, d, layers, heads, seq, mb = SIZES[size]
    params = sum(p.numel() for p in build_gpt(size).parameters())
    head = (
        f"GPT {size} ({params / 1e6:.1f}M params), {ranks} gloo ranks, CPU fp32, commit {commit}"
        f"{' + uncommitted changes' if dirty.stdout.strip() else ''}: "
        f"{steps} interleaved steps after {warmup} warm-up, "
        f"medians of the slower rank; total {time.time() - t0:.0f}s. {_machine()}, load average "
        f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (above ~2, others' work shares the "
        f"cores: read the ratios). Bytes exact: measured == the planner's, asserted."
    )
    print(f"\n{head}")
    print(
        f"{'shard_boundary':14} {'optimizer':9} {'step s':>7} {'/AdamW':>7} {'opt step s':>10} "
        f"{'comm MB/step':>12} {'planner MB':>10} {'whole-matrix MB':>15} {'planner MB':>10}"
    )
    for row in rows.values():
        print(
            f"{row['shard_boundary']:14} {row['optimizer']:9} {row['median_step_s']:7.3f} "
            f"{row['step_ratio_to_adamw']:7.2f} {row['median_opt_step_s']:10.3f} "
            f"{row['comm_mb_per_step']:12.2f} {row['plan_comm_mb_per_step']:10.2f} "
            f"{row['whole_matrix_mb_per_step']:15.2f} {row['plan_whole_matrix_mb_per_step']:10.2f}"
        )
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(
            {"header": head, "commit": commit, "size": size, "ranks": ranks, "steps": steps, "rows": rows, "raw": res},
            f,
            indent=1,
        )
    print(f"wrote {out_path}")
    return rows


def _machine() -> str:
    """The CPU this ran on: its model name and core count."""
    name = "an unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per row (after 2 warm-up)")
    ap.add_argument("--model-size", default="25m", choices=sorted(SIZES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--boundaries", nargs="+", default=list(BOUNDARIES), choices=BOUNDARIES)
    ap.add_argument("--out", default="bench/results/engine_muon.json")
    args = ap.parse_args()
    run(args.model_size, args.ranks, args.steps, args.boundaries, args.out)


if __name__ == "__main__":
    main()
