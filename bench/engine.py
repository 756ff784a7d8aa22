"""Side-by-side step time, memory and traffic: our sharded engine vs torch FSDP2 vs torch DDP.

    .venv/bin/python bench/engine.py                       # ~25M GPT, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/engine.py --steps 4 --model-size tiny
    .venv/bin/python bench/engine_muon.py                  # Muon vs AdamW per shard boundary (also: --muon)

Phase 1 (timing): one 2-rank group builds the three engines from the same initial weights and
runs their steps interleaved (round r runs one step of each, in rotating order, after a barrier),
so background load hits all three alike; we report medians. --timing-runs repeats phase 1 in fresh
processes: the medians pool every run's steps, and each run's ratio to DDP is printed, which
shows how far one run's ratio moves on a shared machine. Phase 2 (memory, and time alone):
--memory-runs rounds of one 2-rank run per engine in its own processes, engines alternating, with
the peak RSS (VmHWM) reset after warm-up, so each engine's high-water mark is its own; the table
shows the median peak, and the median step time of those runs ("alone"); in phase 1 the engines
share one process and its heap. Tensor accounting = bytes of
parameters + gradients + optimizer state + engine-held buffers between steps. Traffic: ours from
`comm_stats()`; FSDP2 counted by wrapping torch.distributed's collective functions in this process; DDP from theory
(its reducer calls gloo from C++): all-reduce of every gradient, 2 (N-1)/N x bytes.
Writes a table to stdout and JSON to --out.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The GPT-like benchmark model and its sizes are the ones every benchmark shares (bench/common.py).
from bench.common import (  # noqa: E402
    SIZES,
    Built,
    WireCounter,
    batch,
    build_engine,
    gpt_params,
    live_tensor_bytes,
    loss_of,
    reset_rss_peak,
    rss_mb,
)
from framework.local_ranks import run_local  # noqa: E402

# ------------------------------------------------------------------ engines
# our engine's variants: ours_gloo over gloo's TCP instead of shared memory
OURS = ("ours", "ours_gloo", "ours_rows", "ours_params", "ours_clip", "ours_det")
BOUNDARY_ROWS = ("ours_rows", "ours_params")  # --boundary-rows: whole rows / whole parameters per rank
# --deterministic: the trainer's step with the gradient norm, default (ours_clip: the engine's
# reduce-scatter and clip_grad_norm_) and under trainer.deterministic (ours_det: the tree-ordered
# reduce-scatter, the canonical norm, the loss's global token count and per-unit loss slots; one unit
# per rank's micro-batch, i.e. trainer.deterministic_unit = micro_batch_size)
DETERMINISTIC_ROWS = ("ours_clip", "ours_det")


def build(engine: str, size: str):
    """`engine` as every benchmark builds it (bench/common.py), with foreach AdamW."""
    base = "ours" if engine in DETERMINISTIC_ROWS else engine
    b = build_engine(base, size, torch.device("cpu"), dist.get_world_size(), foreach=True)
    if engine == "ours_det":
        b.model.set_deterministic_reduction(True)
    return b.model, b.opt


def trainer_step(engine, model, opt, idx, vocab):
    """The trainer's step on one micro-batch per rank, with the gradient norm measured (not
    clipped): framework/trainer.py's default, or framework/deterministic.py's."""
    from framework.distributed.fsdp import clip_grad_norm_
    from framework.distributed.fsdp.canonical import canonical_grad_norm_
    from framework.distributed.fsdp.tree import tree_sum_slots

    ws = dist.get_world_size()
    if engine == "ours_det":
        count = torch.tensor([idx[:, 1:].numel()], dtype=torch.int64)
        dist.all_reduce(count)  # the global batch's labelled tokens
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1), reduction="sum") / count
        loss.backward()
        slots = torch.zeros(ws, dtype=torch.float64)
        slots[dist.get_rank()] = loss.detach().double()
        dist.all_reduce(slots)
        tree_sum_slots(slots)
        canonical_grad_norm_(list(model.parameters()), float("inf"))
    else:
        loss = loss_of(model(idx[:, :-1]), idx)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        clip_grad_norm_([p for p in model.parameters() if p.grad is not None], float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def step(engine, model, opt, size, s, rank):
    vocab, d, layers, heads, seq, mb = SIZES[size]
    if engine in OURS:
        from framework.distributed.fsdp import set_host_transport

        set_host_transport("gloo" if engine == "ours_gloo" else "shm")
    idx = batch(size, s, rank, "cpu")
    dist.barrier()
    t0 = time.perf_counter()
    if engine in DETERMINISTIC_ROWS:
        loss = trainer_step(engine, model, opt, idx, vocab)
    else:
        loss = Built(engine, model, opt).step(idx)
    return time.perf_counter() - t0, loss.item()


def tensor_bytes(engine, model, opt) -> int:
    """Parameters, gradients and optimizer state, plus our engine's buffers held between steps."""
    extra = 0
    if engine in OURS:
        sb = model.sharded_tensor_bytes()
        extra = sb["unsharded"] + sb["accum"] + sb["secondary"] + sb["grad_pool"]
    return live_tensor_bytes(model, opt, extra)


def padding_bytes(model) -> int:
    """Bytes of this rank's shards that hold no parameter ([Note: shard boundaries])."""
    lays = [u.layout for u in model._fsdp_unit.ctx.units]
    return sum(lay.shard_numel - sum(e.local_numel for e in lay.entries) for lay in lays) * 4


def timing_worker(rank, ws, size, steps, warmup, gloo_row=False, boundary_rows=False, deterministic=False):
    counter = WireCounter().install()  # FSDP2's traffic, at torch.distributed's functions
    engines = (
        ["ours", "fsdp2", "ddp"]
        + (["ours_gloo"] if gloo_row else [])
        + (list(BOUNDARY_ROWS) if boundary_rows else [])
        + (list(DETERMINISTIC_ROWS) if deterministic else [])
    )
    built = {e: build(e, size) for e in engines}
    times = {e: [] for e in engines}
    traffic = {e: [] for e in engines}
    exposed = {e: [] for e in OURS}
    for r in range(warmup + steps):
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            model, opt = built[e]
            if e in OURS:
                model.reset_comm_stats()
            before = counter.bytes
            t, _ = step(e, model, opt, size, r, rank)
            if r >= warmup:
                times[e].append(t)
                if e in OURS:
                    st = model.comm_stats()
                    traffic[e].append(
                        st["allgather_bytes"]
                        + st["reduce_scatter_bytes"]
                        + st["allreduce_bytes"]
                        + st["alltoall_bytes"]
                    )
                    exposed[e].append(st["exposed_comm_s"])
                elif e == "fsdp2":
                    traffic[e].append(counter.bytes - before)
    for e in set(engines) & set(OURS):  # each variant ran on the transport it names
        model = built[e][0]
        used = {t.name for u in model._fsdp_unit.ctx.units for t in u.transports()[:2]}
        assert used == {"gloo" if e == "ours_gloo" else "shm"}, (e, used)
    grad_bytes = sum(p.numel() * 4 for p in built["ddp"][0].parameters())
    traffic["ddp"] = [2 * (ws - 1) * grad_bytes // ws]
    tb = {}
    for e in engines:  # one more step without zero_grad so gradients count in the accounting
        model, opt = built[e]
        vocab, *_, seq, mb = SIZES[size]
        idx = torch.randint(0, vocab, (mb, seq + 1))
        F.cross_entropy(model(idx[:, :-1]).reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        opt.step()
        tb[e] = tensor_bytes(e, model, opt)
    return {
        "times": times,
        "traffic": traffic,
        "exposed": exposed,
        "tensor_bytes": tb,
        "padding_bytes": {e: padding_bytes(built[e][0]) for e in engines if e in OURS},
        "params": sum(p.numel() for p in built["ddp"][0].parameters()),
    }


def memory_worker(rank, ws, engine, size, steps=2):
    """One engine alone in its processes: the RSS high-water mark of `steps` steps after 2 warm-up
    ones, and their step times (no other engine's tensors share this heap)."""
    model, opt = build(engine, size)
    for s in range(2):
        step(engine, model, opt, size, s, rank)
    reset_rss_peak()
    base = rss_mb()
    times = [step(engine, model, opt, size, s, rank)[0] for s in range(2, 2 + steps)]
    return {"rss_peak_mb": rss_mb(), "rss_after_warmup_mb": base, "step_s": times}


def gpu_worker(rank, ws, engine, size, steps, warmup, peak_tflops):
    """One engine on this rank's GPU: bf16 compute, fp32 master shards and reduction, AdamW.
    `engine` is "ours" or "fsdp2" (torch's fully_shard, same policy), one block per unit."""
    from framework.metrics import device_peak_tflops

    vocab, d, layers, heads, seq, mb = SIZES[size]
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(dev)
    built = build_engine(engine, size, dev, ws, foreach=True, bf16=True)
    model, opt = built.model, built.opt
    n_params = gpt_params(size)
    times, exposed = [], []
    for s in range(warmup + steps):
        idx = torch.randint(0, vocab, (mb, seq + 1), device=dev)
        if engine.startswith("ours"):
            model.reset_comm_stats()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        built.step(idx)
        torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            exposed.append(model.comm_stats()["exposed_comm_s"] if engine.startswith("ours") else None)
    peak_all = torch.cuda.max_memory_allocated(dev) / 2**30
    # One more step, untimed, for where the peak is: the highest allocation within each phase.
    phases = {}
    idx = torch.randint(0, vocab, (mb, seq + 1), device=dev)
    for phase in ("forward", "backward", "optimizer"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        if phase == "forward":
            loss = loss_of(model(idx[:, :-1]), idx)
        elif phase == "backward":
            loss.backward()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        phases[phase] = torch.cuda.max_memory_allocated(dev) / 2**30
    # training FLOPs per token: 6 x parameters (matmuls fwd+bwd) + 12 x layers x d x seq (attention)
    flops_per_token = 6 * n_params + 12 * layers * d * seq
    out = {
        "times": times,
        "exposed": exposed,
        "params": n_params,
        "tokens_per_step": mb * seq,
        "flops_per_token": flops_per_token,
        "peak_tflops": device_peak_tflops(dev, peak_tflops),
        "peak_mem_gib": peak_all,
        "phase_peak_gib": phases,
        "gpu": torch.cuda.get_device_name(dev),
    }
    del model, opt, loss, built
    torch.cuda.empty_cache()
    return out


def run_gpu(args) -> None:
    """--device cuda: tokens/s, MFU against the GPU's bf16 peak, peak memory, exposed comm; ours,
    then torch FSDP2 on the same model and policy (one process group each)."""
    if not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible; run on a GPU machine or drop --device", file=sys.stderr)
        sys.exit(2)
    rows, raw = {}, {}
    for engine in args.gpu_engines:
        res = run_local(
            gpu_worker,
            args.ranks,
            args=(engine, args.model_size, args.steps, 2, args.peak_tflops),
            device="cuda",
            timeout_s=600,
        )
        r0 = res[0]
        step_s = statistics.median(max(r["times"][i] for r in res) for i in range(args.steps))
        tok_s = args.ranks * r0["tokens_per_step"] / step_s
        peak = r0["peak_tflops"]
        exposed = None
        if r0["exposed"][0] is not None:
            exposed = statistics.median(max(r["exposed"][i] for r in res) for i in range(args.steps))
        rows[engine] = {
            "gpu": r0["gpu"],
            "ranks": args.ranks,
            "params": r0["params"],
            "median_step_s": step_s,
            "min_step_s": min(min(r["times"]) for r in res),
            "max_step_s": max(max(r["times"]) for r in res),
            "tokens_per_s": tok_s,
            "mfu": tok_s * r0["flops_per_token"] / (args.ranks * peak * 1e12) if peak else None,
            "peak_mem_gib": max(r["peak_mem_gib"] for r in res),
            "exposed_comm_s": exposed,
            "phase_peak_gib": {k: max(r["phase_peak_gib"][k] for r in res) for k in r0["phase_peak_gib"]},
        }
        raw[engine] = res
    first = next(iter(rows.values()))
    print(
        f"\nGPT {args.model_size} ({first['params'] / 1e9:.2f}B params), {args.ranks} x {first['gpu']}, "
        f"bf16 compute, fp32 reduce, AdamW, {args.steps} steps after 2 warm-up, medians"
    )
    for engine, row in rows.items():
        mfu = "n/a (unknown GPU: pass --peak-tflops)" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        exp = "n/a" if row["exposed_comm_s"] is None else f"{row['exposed_comm_s']:.4f} s/step"
        print(
            f"{engine:13s} step {row['median_step_s']:.4f} s (min {row['min_step_s']:.4f}, max {row['max_step_s']:.4f})"
            f"  tokens/s {row['tokens_per_s']:,.0f}  MFU {mfu}  peak memory {row['peak_mem_gib']:.2f} GiB/GPU"
            f"  exposed comm {exp}"
        )
        print("       peak within: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in row["phase_peak_gib"].items()))
    for suffix in ("", "+compile"):
        if f"ours{suffix}" in rows and f"fsdp2{suffix}" in rows:
            o, f = rows[f"ours{suffix}"], rows[f"fsdp2{suffix}"]
            print(
                f"ours{suffix} / fsdp2{suffix}: step time {o['median_step_s'] / f['median_step_s']:.3f}x, "
                f"peak memory {o['peak_mem_gib'] / f['peak_mem_gib']:.3f}x"
            )
    out = "bench/engine_gpu.json" if args.out == "bench/engine_results.json" else args.out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "raw": raw}, f, indent=1)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per engine (after 2 warm-up)")
    ap.add_argument("--model-size", default="25m", choices=sorted(SIZES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default="bench/engine_results.json")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument(
        "--timing-runs",
        type=int,
        default=3,
        help="separate runs of the interleaved phase, each in fresh processes (the step medians pool "
        "every run's steps; the per-run ratios to DDP are listed too)",
    )
    ap.add_argument(
        "--memory-runs",
        type=int,
        default=3,
        help="separate runs per engine for the RSS peak (engines alternate; the table shows the median)",
    )
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="also the trainer's step with and without trainer.deterministic (rows ours_clip, ours_det), "
        "interleaved with the others, and in the memory phase",
    )
    ap.add_argument(
        "--gloo-row",
        action="store_true",
        help="also time our engine with parallelism.host_transport=gloo (row ours_gloo), interleaved with the others",
    )
    ap.add_argument(
        "--boundary-rows",
        action="store_true",
        help="also time our engine with whole-row and whole-parameter shard boundaries (rows ours_rows, "
        "ours_params), interleaved with the others; their padding is printed after the table",
    )
    ap.add_argument(
        "--tp",
        action="store_true",
        help="then the tensor-parallel rows (bench/tp.py: our Llama at dp x tp layouts, same --ranks/--steps)",
    )
    ap.add_argument(
        "--muon",
        action="store_true",
        help="then the Muon rows (bench/engine_muon.py: Muon vs AdamW per shard-boundary policy, same "
        "--ranks/--steps/--model-size; its bytes asserted equal to the planner's)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: our engine only, one rank per GPU, bf16 compute; tokens/s, MFU, peak memory "
        "(use --model-size 1b; writes bench/engine_gpu.json)",
    )
    ap.add_argument(
        "--gpu-engines",
        nargs="+",
        default=["ours", "fsdp2"],
        choices=["ours", "fsdp2", "ours+compile", "fsdp2+compile"],
        help="--device cuda: the engines to run, in order (default: ours, then torch FSDP2); +compile: "
        "torch.compile on each block (bench/gpu_check.sh runs all four)",
    )
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak for MFU; 0: look it up")
    args = ap.parse_args()
    if args.device == "cuda":
        run_gpu(args)
        return
    t0 = time.time()
    runs = [
        run_local(
            timing_worker,
            args.ranks,
            args=(args.model_size, args.steps, 2, args.gloo_row, args.boundary_rows, args.deterministic),
            timeout_s=1800,
        )
        for _ in range(max(1, args.timing_runs))
    ]
    res = runs[0]
    mem = {}  # engine -> one list of per-rank results per run
    if not args.skip_memory:
        for _ in range(max(1, args.memory_runs)):
            for e in ("ours", "fsdp2", "ddp") + (DETERMINISTIC_ROWS if args.deterministic else ()):
                run = run_local(memory_worker, args.ranks, args=(e, args.model_size, args.steps), timeout_s=900)
                mem.setdefault(e, []).append(run)
    # a run's peak is its highest rank's; glibc's heap makes it vary by a few percent run to run
    peaks = {e: [max(m["rss_peak_mb"] for m in run) for run in e_runs] for e, e_runs in mem.items()}
    rss = {e: statistics.median(p) for e, p in peaks.items()}
    # step times of the engines alone (each run its own processes), the slower rank of each step
    alone = {
        e: statistics.median(t for run in e_runs for t in map(max, zip(*(m["step_s"] for m in run))))
        for e, e_runs in mem.items()
    }
    r0 = res[0]

    def slowest_rank(run, e):  # each step's time is its slowest rank's
        return [max(r["times"][e][i] for r in run) for i in range(args.steps)]

    med = {e: statistics.median(t for run in runs for t in slowest_rank(run, e)) for e in r0["times"]}
    run_ratio = {
        e: [statistics.median(slowest_rank(run, e)) / statistics.median(slowest_rank(run, "ddp")) for run in runs]
        for e in r0["times"]
    }
    rows = {}
    for e in r0["times"]:
        rows[e] = {
            "median_step_s": med[e],
            "ratio_to_fsdp2": med[e] / med["fsdp2"],
            "ratio_to_ddp": med[e] / med["ddp"],
            "ratio_to_ddp_runs": run_ratio[e],
            "tensor_bytes_mb": max(r["tensor_bytes"][e] for r in res) / 2**20,
            "rss_peak_mb": rss.get(e),
            "rss_peak_runs_mb": peaks.get(e),
            "rss_ratio_to_fsdp2": rss[e] / rss["fsdp2"] if e in rss else None,
            "alone_step_s": alone.get(e),
            "alone_ratio_to_ddp": alone[e] / alone["ddp"] if e in alone else None,
            "comm_mb_per_step": statistics.median(r0["traffic"][e]) / 2**20 if r0["traffic"][e] else None,
            "exposed_comm_s": statistics.median(r0["exposed"][e]) if r0["exposed"].get(e) else None,
            "padding_mb": max(r["padding_bytes"][e] for r in res) / 2**20 if e in OURS else None,
        }
    hdr = (
        f"{'engine':11} {'step s':>8} {'/FSDP2':>7} {'/DDP':>6} {'tensor MB':>10} {'RSS peak MB':>12} "
        f"{'RSS/FSDP2':>10} {'alone s':>8} {'/DDP':>6} {'comm MB/step':>13} {'exposed s':>10}"
    )
    print(
        f"\nGPT {args.model_size} ({r0['params'] / 1e6:.1f}M params), {args.ranks} gloo ranks, CPU fp32, "
        f"{args.timing_runs} x {args.steps} interleaved steps, medians; RSS and 'alone': "
        f"{args.memory_runs} runs of each engine in its own processes ({args.steps} steps each), medians; "
        f"total {time.time() - t0:.0f}s"
    )
    print(hdr)
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    for e, r in rows.items():
        print(
            f"{e:11} {r['median_step_s']:8.3f} {r['ratio_to_fsdp2']:7.2f} {r['ratio_to_ddp']:6.2f} "
            f"{r['tensor_bytes_mb']:10.1f} {fmt(r['rss_peak_mb'], '12.0f'):>12} "
            f"{fmt(r['rss_ratio_to_fsdp2'], '10.2f'):>10} "
            f"{fmt(r['alone_step_s'], '8.3f'):>8} {fmt(r['alone_ratio_to_ddp'], '6.2f'):>6} "
            f"{fmt(r['comm_mb_per_step'], '13.1f'):>13} "
            f"{fmt(r['exposed_comm_s'], '10.3f'):>10}"
        )
    print(
        "padding (MB per rank, the fullest): "
        + "; ".join(f"{e} {r['padding_mb']:.2f}" for e, r in rows.items() if r["padding_mb"] is not None)
    )
    if len(runs) > 1:
        print(
            "step time / DDP in each interleaved run: "
            + "; ".join(f"{e} " + " ".join(f"{x:.2f}" for x in v) for e, v in run_ratio.items() if e != "ddp")
        )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "params": r0["params"], "rows": rows, "raw": runs, "memory": mem}, f, indent=1)
    print(f"wrote {args.out}")
    if args.tp:
        from bench.tp import run as run_tp

        run_tp(args.ranks, args.steps, ["torch", "native"], os.path.splitext(args.out)[0] + "_tp.json")
    if args.muon:
        from bench.engine_muon import BOUNDARIES
        from bench.engine_muon import run as run_muon

        run_muon(args.model_size, args.ranks, args.steps, BOUNDARIES, os.path.splitext(args.out)[0] + "_muon.json")


if __name__ == "__main__":
    main()
