"""The optimizer step on our sharded parameters: AdamW for-loop / foreach / fused, Muon (with its
whole-matrix traffic) and torch's clip_grad_norm_, per shard-boundary policy.

    .venv/bin/python bench/optimizer_step.py                  # 25M GPT, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/optimizer_step.py --out bench/results/optimizer_step_before.json

The optimizer's parameters are `ShardPiece`s ([Note: pieces that describe themselves] in
framework/distributed/fsdp/views.py): every op on them goes through one Python
`__torch_function__` call. This measures what that costs where it is paid, the optimizer step and
the clipping, on the benchmark model, and the trainer's step (`optimizer_step`: an elementwise
optimizer on the plain local data, [Note: the optimizer step on plain local data]): one forward
and backward, then `--repeats` timed calls of each, gradients kept; medians of the slower rank.
Run it at two commits to compare (the JSON names the commit). Writes a table to stdout and JSON to --out.

AdamW with bfloat16 state (`optimizer.state_dtype=bf16`, framework/optim/lowp.py) is timed beside
torch's foreach AdamW on the same parameters, interleaved call by call, with each call's process
CPU time beside its wall time (on a shared machine the wall time counts others' use of the cores);
on a CPU it steps in its compiled loop where one was built (framework/optim/lowp_cpu.py), and
"torch ops" is the same step made by torch's operations, as on a GPU:

    .venv/bin/python bench/optimizer_step.py --boundaries anywhere --repeats 15 --skip-muon \
        --out bench/results/optimizer_step_bf16.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import SIZES, batch, build_gpt, loss_of  # noqa: E402

try:  # run it at older commits too (the JSON names the commit)
    from framework.local_ranks import run_local
except ImportError:  # a commit before the rank starter had its own module
    from framework.runtime import run_local

VARIANTS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def _worker(rank: int, world: int, size: str, boundaries: list, repeats: int, skip_muon: bool = False) -> dict:
    """One rank, in the process group `run_local` made (gloo, one compute thread): its timings."""
    from framework.distributed.fsdp import fully_shard

    takes_boundary = "shard_boundary" in inspect.signature(fully_shard).parameters
    out = {}
    for boundary in boundaries:
        if boundary != "anywhere" and not takes_boundary:
            continue
        kw = {"shard_boundary": boundary} if takes_boundary else {}
        model = build_gpt(size)
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(model, reshard_after_forward=False, **kw)
        idx = batch(size, 0, rank, torch.device("cpu"))
        loss_of(model(idx[:, :-1]), idx).backward()
        try:  # [Note: the optimizer step on plain local data]: how the trainer steps
            from framework.distributed.fsdp import optimizer_step
        except ImportError:  # a commit before it
            optimizer_step = None
        # The same local data as plain tensors (same storage, plain gradients): the step the engine
        # ran before its parameters described themselves, timed beside the pieces' in one run.
        params = list(model.parameters())
        local = [getattr(p, "to_local", p.detach)().detach() for p in params]
        plain = [torch.nn.Parameter(t) for t in local]
        for q, p in zip(plain, params):
            q.grad = getattr(p.grad, "to_local", p.grad.detach)()
        for name, opt_kw in VARIANTS.items():
            opt = torch.optim.AdamW(params, lr=1e-6, **opt_kw)
            opt_plain = torch.optim.AdamW(plain, lr=1e-6, **opt_kw)
            opt.step()  # state allocated outside the timing
            opt_plain.step()
            calls = {"": opt.step, " plain tensors": opt_plain.step}
            if optimizer_step is not None:
                calls[" optimizer_step"] = functools.partial(optimizer_step, opt)
            times = {k: [] for k in calls}
            keys = list(calls)
            for i in range(repeats):  # interleaved, each first in turn
                for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
                    dist.barrier()
                    t = time.perf_counter()
                    calls[k]()
                    times[k].append(time.perf_counter() - t)
            for k, v in times.items():
                out[f"{boundary} {name}{k}"] = v
        _bf16_state_rows(out, boundary, params, plain, optimizer_step, repeats)
        try:
            from framework.optim import build_optimizer, hidden_matrix_names
        except ImportError:  # a commit before optimizer=muon
            build_optimizer = None
        if build_optimizer is not None and not skip_muon:
            from framework.config.schema import OptimizerConfig

            hidden = hidden_matrix_names(build_gpt(size))  # the model as built: its names
            opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-6, muon_lr=1e-6), hidden=hidden)
            opt.step()
            times, traffic = [], []
            for _ in range(repeats):
                dist.barrier()
                model.reset_comm_stats()
                t = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t)
                st = model.comm_stats()
                traffic.append(st["allgather_bytes"] + st["reduce_scatter_bytes"])
            out[f"{boundary} muon"] = times
            out[f"{boundary} muon MB/step"] = [b / 2**20 for b in traffic]
        times = []
        for _ in range(repeats):
            dist.barrier()
            t = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            times.append(time.perf_counter() - t)
        out[f"{boundary} clip_grad_norm_"] = times
    return out


def _bf16_state_rows(out: dict, boundary: str, params: list, plain: list, optimizer_step, repeats: int) -> None:
    """AdamW with bfloat16 state (`AdamWLowState`, `optimizer.state_dtype=bf16`) beside torch's
    foreach AdamW on the same parameters, interleaved call by call, each first in turn: on the
    pieces (`opt.step()`, the trainer's `optimizer_step`) and on the same data as plain tensors.
    Each call's process CPU time is kept beside its wall time (" cpu" rows): on a loaded machine
    the wall time also counts the time other processes hold the cores."""
    try:
        from framework.optim.lowp import AdamWLowState
    except ImportError:  # a commit before bf16 state
        return
    opts = {
        "bf16 state": AdamWLowState(params, lr=1e-6, weight_decay=0.1),
        "bf16 state plain tensors": AdamWLowState(plain, lr=1e-6, weight_decay=0.1),
        "foreach (beside bf16 state)": torch.optim.AdamW(params, lr=1e-6, foreach=True),
        "foreach plain tensors (beside bf16 state)": torch.optim.AdamW(plain, lr=1e-6, foreach=True),
    }
    if "cpu_kernel" in inspect.signature(AdamWLowState).parameters:  # the torch operations, as a GPU steps
        opts["bf16 state torch ops plain tensors"] = AdamWLowState(plain, lr=1e-6, weight_decay=0.1, cpu_kernel=False)
    for opt in opts.values():
        opt.step()  # state allocated outside the timing
    calls = {k: opt.step for k, opt in opts.items()}
    if optimizer_step is not None:
        calls["bf16 state optimizer_step"] = functools.partial(optimizer_step, opts["bf16 state"])
        calls["foreach optimizer_step (beside bf16 state)"] = functools.partial(
            optimizer_step, opts["foreach (beside bf16 state)"]
        )
    keys = list(calls)
    times = {k: [] for k in keys}
    cpu = {k: [] for k in keys}
    for i in range(repeats):
        for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            calls[k]()
            times[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    for k in keys:
        out[f"{boundary} {k}"] = times[k]
        out[f"{boundary} {k} cpu"] = cpu[k]


def _print_bf16_ratios(results: dict, repeats: int) -> None:
    """AdamW with bf16 state against torch's foreach AdamW on the same data, call by call."""
    pairs = {
        "opt.step()": ("bf16 state", "foreach (beside bf16 state)"),
        "optimizer_step": ("bf16 state optimizer_step", "foreach optimizer_step (beside bf16 state)"),
        "plain tensors": ("bf16 state plain tensors", "foreach plain tensors (beside bf16 state)"),
        "plain, torch ops": ("bf16 state torch ops plain tensors", "foreach plain tensors (beside bf16 state)"),
    }
    boundaries = sorted({k.split(" ", 1)[0] for k in results[0] if k.endswith(" bf16 state")})
    if not boundaries:
        return
    print("bf16 state / torch's foreach AdamW on the same data, call by call: median (quartiles), wall | cpu")
    for boundary in boundaries:
        parts = []
        for label, (ours, theirs) in pairs.items():
            if f"{boundary} {ours}" not in results[0]:
                continue
            both = []
            for suffix in ("", " cpu"):
                slowest = lambda k: [max(results[r][k][i] for r in results) for i in range(repeats)]  # noqa: E731
                ratios = [
                    a / b
                    for a, b in zip(slowest(f"{boundary} {ours}{suffix}"), slowest(f"{boundary} {theirs}{suffix}"))
                ]
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                both.append(f"{statistics.median(ratios):.2f} ({q1:.2f}-{q3:.2f})")
            parts.append(f"{label} {' | '.join(both)}")
        print(f"  {boundary:10} " + "   ".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="25m", choices=sorted(SIZES))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--boundaries", nargs="+", default=["anywhere", "rows", "params"])
    ap.add_argument(
        "--skip-muon", action="store_true", help="leave out Muon's rows (its bf16 iterations are slow on CPU)"
    )
    ap.add_argument("--out", default="bench/results/optimizer_step.json")
    args = ap.parse_args()
    load = os.getloadavg()
    # the ranks start as main.py starts its own (framework/local_ranks.py), on the CPU: gloo
    ranks = run_local(
        _worker, args.ranks, args=(args.model_size, args.boundaries, args.repeats, args.skip_muon), timeout_s=1800
    )
    results = dict(enumerate(ranks))  # rank -> its timings
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = {}
    for key in results[0]:
        slowest = [max(results[r][key][i] for r in results) for i in range(args.repeats)]
        rows[key] = statistics.median(slowest) * (1 if key.endswith("MB/step") else 1e3)
    print(
        f"GPT {args.model_size}, {args.ranks} gloo ranks, CPU fp32, commit {commit}: median of {args.repeats} calls, ms"
    )
    print(f"  {_cpu_name()}, load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    try:
        from framework.optim import lowp_cpu
    except ImportError:  # a commit before the compiled loop
        pass
    else:
        why = lowp_cpu.unavailable_reason()
        print(f"  bf16 state on the CPU: {'the compiled loop' if why is None else 'the torch operations: ' + why}")
    for key, ms in rows.items():
        print(f"  {key:52} {ms:9.2f}")
    _print_ratios(results, args.repeats)
    _print_bf16_ratios(results, args.repeats)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        machine = {"cpu": _cpu_name(), "load_average_start_end": [load[0], os.getloadavg()[0]]}
        json.dump(
            {"args": vars(args), "commit": commit, "machine": machine, "median_ms": rows, "raw": results}, f, indent=1
        )
    print(f"wrote {args.out}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} x {len(names)}"
    except (OSError, IndexError):
        return "CPU unknown"


def _print_ratios(results: dict, repeats: int) -> None:
    """Each call against the same data as plain tensors, call by call (the same repeat, interleaved):
    the median ratio and its quartiles, which say whether a difference is more than the noise."""
    keys = [k[: -len(" plain tensors")] for k in results[0] if k.endswith(" plain tensors")]
    if not keys:
        return
    print("ratio to the plain tensors' step, call by call: median (quartiles)")
    for key in keys:
        slowest = lambda k: [max(results[r][k][i] for r in results) for i in range(repeats)]  # noqa: E731
        plain = slowest(f"{key} plain tensors")
        parts = []
        for suffix in ("", " optimizer_step"):
            if f"{key}{suffix}" in results[0]:
                ratios = [a / b for a, b in zip(slowest(f"{key}{suffix}"), plain)]
                q1, _, q3 = statistics.quantiles(ratios, n=4)
                parts.append(f"{suffix.strip() or 'opt.step()'} {statistics.median(ratios):.3f} ({q1:.2f}-{q3:.2f})")
        if parts:  # a plain-tensors row alone (the bf16 state's torch operations) has no ratio here
            print(f"  {key:28} " + "   ".join(parts))


if __name__ == "__main__":
    main()
