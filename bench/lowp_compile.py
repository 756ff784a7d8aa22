"""The bf16-state AdamW step written as one torch function and compiled with `torch.compile`
(inductor's CPU code), beside the compiled C loop that `AdamWLowState` uses on a CPU
(framework/optim/lowp_cpu.py) and torch's foreach AdamW: the first call's time (the compile), each
step's process-CPU time (median of 15, interleaved, one thread), and whether the two compiled
forms give the same bits from the same state.

    .venv/bin/python bench/lowp_compile.py | tee bench/results/lowp_compile.txt
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.optim import lowp, lowp_cpu  # noqa: E402

N = 2628096  # bench/lowp_step.py's parameter count, as one flat tensor
MIX, HIGH16 = 0x45D9F3B, -65536


def step(p, grad, m16, v16, ss, bc, key_m, key_v, w1: float, b2: float, c2: float, eps: float, decay: float):
    """The step of one tensor: torch's AdamW update in float32 from bf16 moments, then both moments
    stochastically rounded with the hash of [Note: bf16 optimizer state and its rounding]."""
    m = torch.lerp(m16.float(), grad, w1)
    v = v16.float() * b2 + c2 * grad * grad
    d = torch.sqrt(v) / bc + eps
    p.copy_(p * decay + (ss * m) / d)
    for x, key, out in ((m, key_m, m16), (v, key_v, v16)):
        b = x.view(torch.int32)
        h = b ^ key
        h = (h ^ ((h >> 16) & 0xFFFF)) * MIX
        h = (h ^ ((h >> 16) & 0xFFFF)) * MIX
        h = (h ^ (h >> 16)) & 0xFFFF
        r = ((b + h) & HIGH16).view(torch.float32)
        out.copy_(torch.where(torch.isnan(x), x, r))


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(N, generator=g) * 0.02, torch.randn(N, generator=g) * 1e-3
    m0, v0 = (torch.randn(N, generator=g) * 1e-3).bfloat16(), (torch.rand(N, generator=g) * 1e-6).bfloat16()
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-8, 0.1
    ss, bc = torch.tensor([-lr / (1 - b1**3)]), torch.tensor([(1 - b2**3) ** 0.5])
    km, kv = torch.tensor([12345], dtype=torch.int32), torch.tensor([-777], dtype=torch.int32)
    scalars = (1 - b1, b2, 1 - b2, eps, 1 - lr * wd)

    compiled = torch.compile(step, dynamic=False)
    pc, mc, vc = p0.clone(), m0.clone(), v0.clone()
    t = time.perf_counter()
    compiled(pc, grad, mc, vc, ss[0], bc[0], km[0], kv[0], *scalars)
    first = time.perf_counter() - t

    lib = lowp.cpu_library()
    if lib is None:
        raise SystemExit(f"no compiled loop: {lowp_cpu.unavailable_reason()}")
    pl, ml, vl = p0.clone(), m0.clone(), v0.clone()
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    lowp_cpu.adamw_step(lib, [(pl, grad, ml, vl)], km, kv, ss, bc, **kw)
    differ = {
        k: int((a.float().view(torch.int32) != b.float().view(torch.int32)).sum())
        for k, a, b in (("param", pc, pl), ("exp_avg", mc, ml), ("exp_avg_sq", vc, vl))
    }

    ref_p = torch.nn.Parameter(p0.clone())
    ref_p.grad = grad
    ref = torch.optim.AdamW([ref_p], lr=lr, weight_decay=wd, foreach=True)
    ref.step()
    calls = {
        "torch AdamW foreach (float32 state)": ref.step,
        "torch.compile of the bf16-state step": lambda: compiled(
            pc, grad, mc, vc, ss[0], bc[0], km[0], kv[0], *scalars
        ),
        "compiled C loop (AdamWLowState on a CPU)": lambda: lowp_cpu.adamw_step(
            lib, [(pl, grad, ml, vl)], km, kv, ss, bc, **kw
        ),
    }
    cpu = {k: [] for k in calls}
    load = os.getloadavg()[0]
    with torch.no_grad():
        for i in range(15):
            keys = list(calls)
            for k in keys[i % 3 :] + keys[: i % 3]:
                c = time.process_time()
                calls[k]()
                cpu[k].append(time.process_time() - c)
    print(f"{N} elements, one thread, median process-CPU ms of 15 calls; load average {load:.2f} at the start")
    print(f"  torch.compile's first call (the compile): {first:.1f} s wall")
    base = statistics.median(cpu["torch AdamW foreach (float32 state)"])
    for k, v in cpu.items():
        print(f"  {k:42} {statistics.median(v) * 1e3:8.2f}  {statistics.median(v) / base:5.2f}x foreach")
    print(f"  elements whose bits differ, torch.compile vs the C loop, one step from the same state: {differ}")


if __name__ == "__main__":
    main()
