"""Our engine against every engine users would pick instead, on the same models and data.

    .venv/bin/python bench/peers.py                                   # 25M and 125M GPT, 2 and 4 ranks
    .venv/bin/python bench/peers.py --sizes tiny --ranks 2 --steps 3  # a quick check of the script
    .venv/bin/python bench/peers.py --scaling --compile               # + ranks 1,2,4 and torch.compile

Engines: ours (full = ZeRO-3, grad_op = ZeRO-2, hybrid = sharded within 2-rank groups and
replicated across them, int8 = ZeRO++-style quantized communication), torch FSDP2
(`fully_shard`), torch DDP, DeepSpeed ZeRO-2 and ZeRO-3 (optional: `pip install -r
requirements-bench.lock`; on CPU with DS_ACCELERATOR=cpu, gloo and torch's AdamW).

Timing: for each (model, ranks) one process group builds every engine from the same initial weights
and runs their steps interleaved (round r runs one step of each engine in a rotating order, after
a barrier), so background load hits all alike; a step's time is its slowest rank's; we report the
median with min and max over the measured rounds. Bytes per step: ours from `comm_stats()`, FSDP2
and DeepSpeed counted at torch.distributed's collectives, DDP from theory (its reducer calls the
backend from C++): an all-reduce of every gradient, 2 (N-1)/N x bytes. Exposed communication: the
time a step spends blocked on communication (ours counts it; the others do not expose it).
Memory: each engine again in processes of its own, the peak of bytes allocated by torch from
before the model is built through three steps (CUDA: the allocator's peak; CPU: torch.profiler's
allocation events) and the process's peak RSS.

The same script runs unchanged on CUDA machines (NCCL, one GPU per rank); there it also reports
tokens/s per GPU and MFU against the GPU's bf16 peak (from framework/planner/devices.py).
Writes bench/peers_results.json, a markdown table (stdout) and bench/peers_results.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (
    SIZES,
    WireCounter,
    batch,
    build_engine,
    flops_per_token,
    gpt_params,
    live_tensor_bytes,
    machine,
    peak_delta_bytes,
    rss_mb,
    spawn,
)

ENGINES = ["ours_full", "ours_grad_op", "ours_hybrid", "ours_int8", "fsdp2", "ddp", "ds_zero2", "ds_zero3"]
LABELS = {
    "ours_full": "ours ZeRO-3",
    "ours_grad_op": "ours ZeRO-2",
    "ours_hybrid": "ours hybrid",
    "ours_int8": "ours int8 comm",
    "fsdp2": "torch FSDP2",
    "ddp": "torch DDP",
    "ds_zero2": "DeepSpeed ZeRO-2",
    "ds_zero3": "DeepSpeed ZeRO-3",
    "ours_full+compile": "ours ZeRO-3 + compile",
    "fsdp2+compile": "FSDP2 + compile",
}


def have_deepspeed() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except ImportError:
        return False


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_worker(rank, world, device, size, engines, steps, warmup):
    counter = WireCounter().install()
    built = {e: build_engine(e, size, device, world) for e in engines}
    times = {e: [] for e in engines}
    wire = {e: [] for e in engines}
    exposed = {e: [] for e in engines}
    for r in range(warmup + steps):
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            b = built[e]
            idx = batch(size, r, rank, device)
            if hasattr(b.model, "reset_comm_stats"):
                b.model.reset_comm_stats()
            before = counter.bytes
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            b.step(idx)
            _sync(device)
            dt = time.perf_counter() - t0
            if r < warmup:
                continue
            times[e].append(dt)
            stats = b.comm()
            if stats is not None:
                wire[e].append(
                    stats["allgather_bytes"]
                    + stats["reduce_scatter_bytes"]
                    + stats["allreduce_bytes"]
                    + stats["alltoall_bytes"]
                )
                exposed[e].append(stats["exposed_comm_s"])
            elif e == "ddp":
                grads = sum(p.numel() * p.element_size() for p in b.model.parameters())
                wire[e].append(2 * (world - 1) * grads // world)
            else:
                wire[e].append(counter.bytes - before)
    params = gpt_params(size)
    return {"times": times, "wire": wire, "exposed": exposed, "params": params}


def memory_worker(rank, world, device, size, engine):
    def run():
        b = build_engine(engine, size, device, world)
        for s in range(3):
            b.step(batch(size, s, rank, device))
        run.held = live_tensor_bytes(b.model, b.opt) if b.opt is not None else None

    peak = peak_delta_bytes(run, device)
    return {"peak_bytes": peak, "rss_peak_mb": rss_mb(), "model_state_bytes": run.held}


def measure(size: str, world: int, engines, steps: int, warmup: int, memory: bool) -> dict:
    res = spawn(timing_worker, world, args=(size, engines, steps, warmup))
    rows = {}
    for e in engines:
        per_step = [max(r["times"][e][i] for r in res) for i in range(steps)]
        rows[e] = {
            "median_s": statistics.median(per_step),
            "min_s": min(per_step),
            "max_s": max(per_step),
            "step_s": per_step,
            "bytes_per_step": statistics.median(res[0]["wire"][e]) if res[0]["wire"][e] else None,
            "exposed_comm_s": statistics.median(res[0]["exposed"][e]) if res[0]["exposed"][e] else None,
        }
        if memory:
            mem = spawn(memory_worker, world, args=(size, e))
            rows[e]["peak_mb"] = max(m["peak_bytes"] for m in mem) / 2**20
            rows[e]["rss_peak_mb"] = max(m["rss_peak_mb"] for m in mem)
    ref = rows.get("ours_full") or next(iter(rows.values()))
    tokens = SIZES[size][4] * SIZES[size][5]  # per rank per step
    peak = _bf16_peak_tflops()
    for row in rows.values():
        row["ratio_to_ours"] = row["median_s"] / ref["median_s"]
        row["tokens_per_s_per_rank"] = tokens / row["median_s"]
        if peak:
            row["mfu_bf16"] = flops_per_token(size) * row["tokens_per_s_per_rank"] / (peak * 1e12)
    return {"size": size, "ranks": world, "params": res[0]["params"], "steps": steps, "rows": rows}


def _bf16_peak_tflops() -> float:
    if not torch.cuda.is_available():
        return 0.0
    from framework.planner.devices import DEVICES

    name = torch.cuda.get_device_name(0).lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return DEVICES[key].tflops_bf16
    return 0.0


# ------------------------------------------------------------------ scaling and compile
def scaling_worker(rank, world, device, size, steps):
    b = build_engine("ours_full", size, device, world)
    times = []
    for s in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        b.step(batch(size, s, rank, device))
        _sync(device)
        if s:
            times.append(time.perf_counter() - t0)
    b.step(batch(size, steps + 1, rank, device), zero_grad=False)  # gradients count as model state
    return {"times": times, "model_state_bytes": live_tensor_bytes(b.model, b.opt)}


def scaling(size: str, ranks, steps: int) -> list:
    from framework.planner import zero_model_state_bytes

    params = gpt_params(size)
    out = []
    for n in ranks:
        res = spawn(scaling_worker, n, args=(size, steps))
        per_step = [max(r["times"][i] for r in res) for i in range(steps)]
        state = max(r["model_state_bytes"] for r in res)
        # fp32 Adam without a 16-bit copy: 4 B parameters + 4 B gradients + 8 B moments.
        formula = zero_model_state_bytes(params, n, 3, k=8, param_bytes=4, grad_bytes=4)
        out.append(
            {
                "ranks": n,
                "median_s": statistics.median(per_step),
                "model_state_mb": state / 2**20,
                "zero3_formula_mb": formula / 2**20,
                "ddp_formula_mb": zero_model_state_bytes(params, n, 0, k=8, param_bytes=4, grad_bytes=4) / 2**20,
            }
        )
    return out


# ------------------------------------------------------------------ reporting
def table(result: dict) -> str:
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    lines = [
        (
            f"GPT {result['size']} ({result['params'] / 1e6:.1f}M parameters), {result['ranks']} ranks, "
            f"{result['steps']} interleaved steps"
        ),
        "",
        "| engine | median step s (min-max) | / ours ZeRO-3 | peak MB / rank | RSS peak MB | MB / step "
        "| exposed comm s | tokens/s / rank | MFU (bf16 peak) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e, r in result["rows"].items():
        wire = None if r["bytes_per_step"] is None else r["bytes_per_step"] / 2**20
        mfu = None if r.get("mfu_bf16") is None else 100 * r["mfu_bf16"]
        lines.append(
            f"| {LABELS.get(e, e)} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
            f"{r['ratio_to_ours']:.2f} | {fmt(r.get('peak_mb'), '.0f')} | "
            f"{fmt(r.get('rss_peak_mb'), '.0f')} | "
            f"{fmt(wire, '.1f')} | {fmt(r['exposed_comm_s'], '.3f')} | "
            f"{r['tokens_per_s_per_rank']:.0f} | {fmt(mfu, '.1f')}{'%' if mfu is not None else ''} |"
        )
    return "\n".join(lines)


def plot(results: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        names = list(res["rows"])
        med = [res["rows"][e]["median_s"] for e in names]
        lo = [m - res["rows"][e]["min_s"] for m, e in zip(med, names)]
        hi = [res["rows"][e]["max_s"] - m for m, e in zip(med, names)]
        ax.bar(
            range(len(names)),
            med,
            yerr=[lo, hi],
            capsize=3,
            color=["tab:blue" if e.startswith("ours") else "tab:gray" for e in names],
        )
        ax.set_xticks(range(len(names)), [LABELS.get(e, e) for e in names], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"GPT {res['size']}, {res['ranks']} ranks")
        ax.set_ylabel("step time (s), median with min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["25m", "125m"], choices=sorted(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--engines", nargs="+", default=None, help=f"default: all of {' '.join(ENGINES)}")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per engine")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--scaling", action="store_true", help="ours ZeRO-3 at 1, 2, 4 ranks vs the ZeRO formulas")
    ap.add_argument("--compile", action="store_true", help="torch.compile per block: ours and FSDP2 vs eager")
    ap.add_argument("--out", default="bench/peers_results.json")
    args = ap.parse_args()
    engines = args.engines or [e for e in ENGINES if not e.startswith("ds_") or have_deepspeed()]
    t0 = time.time()
    report = {"machine": machine(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "results": []}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save() -> None:  # after every configuration: a later one that fails loses nothing measured
        report["seconds"] = time.time() - t0
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.out)

    for size in args.sizes:
        for world in args.ranks:
            res = measure(size, world, engines, args.steps, args.warmup, not args.skip_memory)
            report["results"].append(res)
            save()
            print(table(res) + "\n", flush=True)
    if args.scaling:
        report["scaling"] = {size: scaling(size, [1, 2, 4], args.steps) for size in args.sizes[:1]}
        print("| ranks | median step s | model state MB / rank | ZeRO-3 formula MB | DDP formula MB |")
        print("|---|---|---|---|---|")
        for row in next(iter(report["scaling"].values())):
            print(
                f"| {row['ranks']} | {row['median_s']:.3f} | {row['model_state_mb']:.1f} | "
                f"{row['zero3_formula_mb']:.1f} | {row['ddp_formula_mb']:.1f} |"
            )
        print()
        save()
    if args.compile:
        res = measure(
            args.sizes[0],
            args.ranks[0],
            ["ours_full", "ours_full+compile", "fsdp2", "fsdp2+compile"],
            args.steps,
            args.warmup,
            memory=False,
        )
        report["compile"] = res
        print(table(res) + "\n")
    save()
    png = os.path.splitext(args.out)[0] + ".png"
    plot(report["results"], png)
    print(f"wrote {args.out} and {png} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
