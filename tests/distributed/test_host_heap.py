"""Free host pages go back to the OS once per backward ([Note: free host pages go back before the
last unit's backward] in framework/distributed/fsdp/host_heap.py).

What the engine promises: on CPU, exactly one trim per backward, after every unit's reduction
but the last one's has been issued and before the last unit's gradients; none when it is turned
off (in a script or from the config); and not a bit of the training changes. That the trim
really hands pages back is checked on the C heap itself, in a fresh process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from framework.distributed.fsdp import host_heap
from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.timeout(300)

needs_glibc = pytest.mark.skipif(host_heap._malloc_trim() is None, reason="the C library has no malloc_trim")


class _LM(nn.Module):
    """Embedding tied to the head (the root's own parameters), three blocks as units."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        mlp = lambda: nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.blocks = nn.ModuleList(mlp() for _ in range(3))

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b(h)
        return h @ self.emb.weight.t()


def _train_worker(rank, world, trim, steps, accumulate):
    from framework.distributed.fsdp import context as Cx
    from framework.distributed.fsdp import fully_shard, set_host_memory_trim

    set_host_memory_trim(trim)
    calls = []  # per call: which units' reductions were issued (in reduce order), and what the trim returned
    real = Cx.trim_host_heap

    def recording_trim():
        units = model._fsdp_unit.ctx.reduce_order
        calls.append(([u._reduce_issued for u in units], real()))
        return calls[-1][1]

    Cx.trim_host_heap = recording_trim
    try:
        torch.manual_seed(0)
        model = _LM()
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        losses, per_step = [], []
        for _ in range(steps):
            before = len(calls)
            for micro in range(2 if accumulate else 1):
                if accumulate:
                    model.set_requires_gradient_sync(micro == 1)
                idx = torch.randint(0, 64, (4, 16), generator=g)
                loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 64), idx[:, 1:].reshape(-1))
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
        params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        return {"losses": losses, "params": params, "per_step": per_step, "calls": calls}
    finally:
        Cx.trim_host_heap = real


@needs_glibc
def test_one_trim_per_backward_before_the_last_unit():
    out = run_ranks(_train_worker, 2, args=(True, 3, False), timeout_s=240)
    for r in out:
        assert r["per_step"] == [1, 1, 1]
        for issued, trimmed in r["calls"]:
            # reduce order: the blocks last to first, then the root (the tied embedding) last
            assert issued == [True, True, True, False]
            assert trimmed is True


@needs_glibc
def test_accumulation_steps_trim_once_per_backward():
    out = run_ranks(_train_worker, 2, args=(True, 2, True), timeout_s=240)
    for r in out:
        assert r["per_step"] == [2, 2]  # two backwards (one without sync) per optimizer step
        assert all(issued == [True, True, True, False] for issued, _ in r["calls"])


def test_turned_off_it_trims_nothing_and_training_is_bit_identical():
    on = run_ranks(_train_worker, 2, args=(True, 3, False), timeout_s=240)
    off = run_ranks(_train_worker, 2, args=(False, 3, False), timeout_s=240)
    for a, b in zip(on, off):
        assert [t for _, t in b["calls"]] == [False, False, False]  # called, and did nothing
        assert a["losses"] == b["losses"]
        assert a["params"] == b["params"]


def test_config_turns_it_off():
    from framework.config.schema import ParallelismConfig
    from framework.distributed.engines import NativeEngine

    try:
        NativeEngine().configure(ParallelismConfig(host_memory_trim=False))
        assert host_heap.host_memory_trim_enabled() is False
        assert host_heap.trim_host_heap() is False
        NativeEngine().configure(ParallelismConfig())
        assert host_heap.host_memory_trim_enabled() is True
    finally:
        host_heap.set_host_memory_trim(True)


@needs_glibc
def test_trim_hands_free_heap_pages_back():
    """In a fresh process: fill the heap with 96 KiB tensors (below glibc's mmap threshold), free
    every other one so the holes cannot go back from the top, and trim."""
    code = textwrap.dedent(
        """
        import torch
        from framework.distributed.fsdp.host_heap import trim_host_heap

        def anon_kb():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))

        ts = [torch.ones(24 * 1024) for _ in range(2000)]  # 2000 x 96 KiB = 188 MiB
        keep = ts[1::2]
        del ts
        before = anon_kb()
        assert trim_host_heap()
        after = anon_kb()
        assert all(float(t[0]) == 1.0 and float(t[-1]) == 1.0 for t in keep)  # in-use memory untouched
        print(before - after)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released_kb = int(out.stdout.strip().splitlines()[-1])
    assert released_kb > 60 * 1024  # of the ~94 MiB freed in holes (whole pages of each)
