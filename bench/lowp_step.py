"""One process's AdamW step with bfloat16 state (`AdamWLowState`, framework/optim/lowp.py) against
torch's AdamW (foreach and for-loop, float32 state) on the same 2.6M parameters: in the compiled
CPU loop ([Note: the bf16-state AdamW step in one pass on a CPU], where it can be built) and made
by torch's operations per chunk size of that step ([Note: the bf16-state AdamW step on tensor
lists]; `cpu_kernel=False`, the path a GPU takes): every optimizer stepped in turn,
interleaved call by call, one compute thread; the median wall and process-CPU time of each, and
the median ratio to torch's foreach step call by call.

    .venv/bin/python bench/lowp_step.py --out bench/results/lowp_step.json
    .venv/bin/python bench/lowp_step.py --before 2cee853   # also the AdamWLowState of that commit

`--before COMMIT` adds the `AdamWLowState` of framework/optim/lowp.py at COMMIT (read with
`git show`), interleaved with the others.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.optim import lowp  # noqa: E402

# a 2-layer, d=256 GPT's tensors: an embedding (4096 x 256), then per layer qkv, proj and a 4x MLP
# with their biases, and four 256-element norm vectors per layer (2,628,096 elements)
SHAPES = [(4096, 256)] + [(768, 256), (768,), (256, 256), (256,), (1024, 256), (1024,), (256, 1024), (256,)] * 2
SHAPES += [(256,)] * 8


def _params() -> list:
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def _low(chunk: int, cpu_kernel: bool = False):
    opt = lowp.AdamWLowState(_params(), lr=1e-6, weight_decay=0.1, cpu_kernel=cpu_kernel)

    def step():
        saved, lowp.CHUNK_CPU = lowp.CHUNK_CPU, chunk
        try:
            opt.step()
        finally:
            lowp.CHUNK_CPU = saved

    return step


def _before(commit: str):
    """`AdamWLowState` as framework/optim/lowp.py defines it at `commit`."""
    text = subprocess.run(
        ["git", "show", f"{commit}:framework/optim/lowp.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("lowp_before", f.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(f.name)
    return module.AdamWLowState(_params(), lr=1e-6, weight_decay=0.1).step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--chunks", type=int, nargs="+", default=[15, 17, 19, 21, 24], help="log2 of CHUNK_CPU")
    ap.add_argument("--before", default=None, help="a commit whose AdamWLowState is timed too")
    ap.add_argument("--out", default="bench/results/lowp_step.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    calls = {
        "torch AdamW foreach": torch.optim.AdamW(_params(), lr=1e-6, weight_decay=0.1, foreach=True).step,
        "torch AdamW for-loop": torch.optim.AdamW(_params(), lr=1e-6, weight_decay=0.1, foreach=False).step,
    }
    if args.before:
        calls[f"bf16 state at {args.before}"] = _before(args.before)
    from framework.optim import lowp_cpu

    if lowp.cpu_library() is not None:
        calls["bf16 state, compiled loop"] = _low(lowp.CHUNK_CPU, cpu_kernel=True)
    else:
        print(f"no compiled loop: {lowp_cpu.unavailable_reason()}")
    for c in args.chunks:
        calls[f"bf16 state, torch ops, chunks of 2^{c}"] = _low(1 << c)
    for step in calls.values():
        step()  # state allocated outside the timing
    load = os.getloadavg()
    keys = list(calls)
    wall = {k: [] for k in keys}
    cpu = {k: [] for k in keys}
    for i in range(args.repeats):
        for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
            t, c = time.perf_counter(), time.process_time()
            calls[k]()
            wall[k].append(time.perf_counter() - t)
            cpu[k].append(time.process_time() - c)
    cpu_name = "unknown"
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu_name = f"{names[0]} x {len(names)}" if names else cpu_name
    print(f"{sum(p.numel() for p in _params())} parameters, one thread, median of {args.repeats} steps")
    print(f"{cpu_name}; load average {load[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"  {'step':28} {'wall ms':>9} {'cpu ms':>9}   / foreach, call by call: wall, cpu")
    base = "torch AdamW foreach"
    rows = {}
    for k in keys:
        rw = statistics.median(a / b for a, b in zip(wall[k], wall[base]))
        rc = statistics.median(a / b for a, b in zip(cpu[k], cpu[base]))
        rows[k] = {
            "wall_ms": statistics.median(wall[k]) * 1e3,
            "cpu_ms": statistics.median(cpu[k]) * 1e3,
            "wall_ratio": rw,
            "cpu_ratio": rc,
        }
        print(f"  {k:28} {rows[k]['wall_ms']:9.2f} {rows[k]['cpu_ms']:9.2f}   {rw:5.2f} {rc:5.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        machine = {"cpu": cpu_name, "load_average_start_end": [load[0], os.getloadavg()[0]]}
        json.dump({"args": vars(args), "machine": machine, "rows": rows, "wall": wall, "cpu": cpu}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
