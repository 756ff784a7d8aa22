"""In-memory snapshots (checkpoint.memory_interval) on the benchmark GPT: what they cost a step at
interval 10, and how long a restore takes from memory against the disk checkpoint of the same state.

    .venv/bin/python bench/memory_snapshots.py                       # ~25M GPT, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/memory_snapshots.py --model-size tiny --rounds 1 --out /tmp/snap.json

The benchmark GPT (bench/common.py) under our engine (every block one unit) with AdamW and the
trainer's LR schedule, on 2 ranks started as main.py starts them. The training steps run in
rounds, each round `interval` steps without snapshots, then `interval` steps with a snapshot on
the last (framework/checkpoint/memory.py, exactly as the trainer calls it), then `interval` steps
while the writer thread is busy beside them: the per-step cost is the mean step of the last two
blocks (a snapshot's copy on its step and its write beside the next ones) against the first, and
the cost per step at the interval is that extra time, once per `interval` steps. Then
the same state is restored from memory (MemorySnapshots.restore: agreeing on the step, reading the
segment, checking its sha256, loading the state dicts) and saved to and loaded from a disk
checkpoint (CheckpointManager.save, then .load: DCP, with the manifest's sha256 of every file),
each timed on the slower rank. The disk is this machine's local one, its files still in the page
cache (the best case for a disk; a parallel file system under load is slower). The timings come
from a shared 2-core machine unless the output says otherwise: read the ratios, not the seconds.
Writes a table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import SIZES, batch, build_engine, gpt_params  # noqa: E402
from framework.local_ranks import run_local  # noqa: E402


class _Position:
    """The data position a resume needs (the loader's state_dict), for a benchmark without data."""

    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed_samples"])


def worker(rank, ws, size, interval, rounds, workdir):
    from framework.checkpoint import CheckpointManager, layout
    from framework.checkpoint.memory import MemorySnapshots
    from framework.config import compose_config, to_config
    from framework.distributed.engines import engine_of
    from framework.optim import build_scheduler
    from framework.runtime import Runtime
    from framework.train_state import TrainState

    device = torch.device("cpu")
    cfg = to_config(
        compose_config(
            [
                "model=debug",
                "data=synthetic",
                f"checkpoint.memory_interval={interval}",
                f"checkpoint.memory_dir={workdir}/shm",
                f"checkpoint.dir={workdir}/checkpoints",
                "checkpoint.keep_last=1",
            ]
        )
    )
    cfg.run_dir = f"{workdir}/run"
    rt = Runtime(rank, ws, rank, device)
    built = build_engine("ours", size, device, ws)
    loader = _Position()
    state = TrainState(built.model, built.opt, build_scheduler(built.opt, cfg.optimizer, 10_000), loader)
    snaps = MemorySnapshots(cfg, rt, engine_of("native"))
    mb = SIZES[size][5]

    def steps(n, snapshot_last=False):
        times = []
        for _ in range(n):
            dist.barrier()
            tic = time.perf_counter()
            built.step(batch(size, state.step, rank, device))
            state.scheduler.step()
            state.step += 1
            loader.consumed += mb * ws
            if snapshot_last and state.step % interval == 0:
                snaps.snapshot(state)
            times.append(time.perf_counter() - tic)
        return times

    steps(3)  # warm-up
    while state.step % interval:
        steps(1)
    off, on, copies, writes = [], [], [], []
    for _ in range(rounds):
        off += steps(interval)
        on += steps(interval, snapshot_last=True)  # the snapshot on the last step of this block
        copies.append(snaps.last_copy_s)
        on += steps(interval - 1)  # the writer thread runs beside these
        snaps.wait()
        writes.append(snaps.last_write_s)
        steps(1)  # keep the step a multiple of the interval for the next round
    snaps.snapshot(state)  # the state both restores bring back
    snaps.wait()
    dist.barrier()  # every rank's writer done: the directory holds both ranks' segments whole
    snapshot_step = state.step
    segment_bytes = sum(os.path.getsize(os.path.join(snaps.dir, n)) for n in os.listdir(snaps.dir))

    dist.barrier()
    tic = time.perf_counter()
    restored = snaps.restore(state, None)
    memory_s = time.perf_counter() - tic
    assert restored == snapshot_step, (restored, snapshot_step)

    ckpt = CheckpointManager(cfg, cfg.run_dir, rt)
    dist.barrier()
    tic = time.perf_counter()
    ckpt.save(state, blocking=True)
    save_s = time.perf_counter() - tic
    path = layout.latest_checkpoint(ckpt.root)
    dist.barrier()
    tic = time.perf_counter()
    loaded = ckpt.load(state, path)
    disk_s = time.perf_counter() - tic
    assert loaded == snapshot_step
    snaps.close(finished=True)
    return {
        "off_step_s": off,
        "on_step_s": on,
        "copy_s": copies,
        "write_s": writes,
        "restore_memory_s": memory_s,
        "restore_disk_s": disk_s,
        "save_disk_s": save_s,
        "segment_bytes_per_node": segment_bytes,
    }


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-snapshots-") as workdir:
        os.makedirs(f"{workdir}/shm")
        results = run_local(worker, args.ranks, (args.model_size, args.interval, args.rounds, workdir))
    slow = lambda key: max(r[key] for r in results)  # noqa: E731  (the slower rank decides)
    off = statistics.mean(max(col) for col in zip(*(r["off_step_s"] for r in results)))
    on = statistics.mean(max(col) for col in zip(*(r["on_step_s"] for r in results)))
    out = {
        "model_size": args.model_size,
        "params": gpt_params(args.model_size),
        "ranks": args.ranks,
        "interval": args.interval,
        "rounds": args.rounds,
        "step_s_without": off,
        "step_s_with": on,
        "step_s_without_stdev": statistics.stdev(max(col) for col in zip(*(r["off_step_s"] for r in results))),
        # one snapshot's extra time (its copy, and its write beside the next steps), once every
        # `interval` steps: the cost per step at that interval
        "cost_per_step": (on - off) * (2 * args.interval - 1) / args.interval / off,
        "copy_s": statistics.mean(max(c) for c in zip(*(r["copy_s"] for r in results))),
        "write_s": statistics.mean(max(c) for c in zip(*(r["write_s"] for r in results))),
        "restore_memory_s": slow("restore_memory_s"),
        "restore_disk_s": slow("restore_disk_s"),
        "save_disk_s": slow("save_disk_s"),
        "segment_bytes_per_node": results[0]["segment_bytes_per_node"],
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(
        f"memory snapshots, GPT {args.model_size} ({out['params'] / 1e6:.1f}M), {args.ranks} ranks, "
        f"interval {args.interval}, {args.rounds} rounds"
    )
    print(f"  step without snapshots          {off * 1e3:8.1f} ms   (stdev {out['step_s_without_stdev'] * 1e3:.1f})")
    print(
        f"  step with a snapshot's work     {on * 1e3:8.1f} ms   (mean of the {2 * args.interval - 1} steps it touches)"
    )
    print(f"  cost at interval {args.interval:<3}           {100 * out['cost_per_step']:+8.1f} %  per step")
    copy = out["copy_s"] / args.interval / off
    at = f"{100 * copy:.2f}% per step at interval {args.interval}"
    print(f"  a snapshot's copy on its step   {out['copy_s'] * 1e3:8.1f} ms   ({at})")
    print(f"  its write, beside training      {out['write_s'] * 1e3:8.1f} ms")
    print(f"  restore from memory             {out['restore_memory_s'] * 1e3:8.1f} ms")
    disk, save = out["restore_disk_s"] * 1e3, out["save_disk_s"] * 1e3
    print(f"  restore from disk (same state)  {disk:8.1f} ms   (save {save:.0f} ms)")
    print(f"  snapshot bytes on the node      {out['segment_bytes_per_node'] / 2**20:8.1f} MiB")
    print(f"  machine: {out['cpus']} CPUs, load average {out['load_average'][0]:.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="25m", choices=sorted(SIZES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.memory_interval")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (interval off, 2 x interval on)")
    ap.add_argument("--out", default="bench/results/memory_snapshots.json")
    args = ap.parse_args()
    out = run(args)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
