"""A step's CPU peak read straight from the profiler's records equals the same peak read through
torch's event list ([Note: a step's peak from the profiler's records] in framework/profiling.py).

The planner's tests and the benchmarks compare planned bytes with this reading; it must stay the
number torch's own view gives: ops' self memory usage at their starts, allocations outside every op
at their own times, in time order. The reference below builds torch's view (`prof.events()`, its
op tree) and sums it; the fast reading must give the same integer on a training step on one
process (allocations on the autograd and a helper thread too) and on sharded ranks whose gloo
collectives are asynchronous ops.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from framework.profiling import _peak_of_records
from tests.distributed.harness import run_ranks

MODEL = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)


def _peak_of_torchs_view(prof) -> int:
    items = []
    for e in prof.events():
        usage = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if usage:
            items.append((e.time_range.start, usage))
    cur = peak = 0
    for _, usage in sorted(items):
        cur += usage
        peak = max(peak, cur)
    return peak


def _both(step) -> tuple[int, int]:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return _peak_of_records(prof.profiler.kineto_results), _peak_of_torchs_view(prof)


def _model():
    from framework.config import ModelConfig
    from framework.models.llama import build_llama

    torch.manual_seed(0)
    model = build_llama(ModelConfig(args=MODEL))
    model.init_weights(0)
    return model


def _step(model, opt, g):
    tokens = torch.randint(0, MODEL["vocab_size"], (4, 17), generator=g)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_the_records_give_torchs_peak_on_one_process():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step_with_a_thread():
        # allocations on another thread while the step's ops run on this one
        side = threading.Thread(target=lambda: [torch.ones(4096) * 2 for _ in range(20)])
        side.start()
        _step(model, opt, g)
        side.join()

    readings = [_both(step_with_a_thread) for _ in range(3)]
    for fast, reference in readings:
        assert fast == reference, readings
    assert all(fast > 0 for fast, _ in readings)


def _sharded_ranks(rank: int, world: int):
    from framework.distributed.fsdp import fully_shard

    model = _model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(rank)
    _step(model, opt, g)

    def step_and_all_reduce():
        # a gloo collective of the process group itself (as tensor parallel's): an asynchronous op
        # in the trace, which nests and counts nothing in torch's view
        _step(model, opt, g)
        torch.distributed.all_reduce(torch.ones(1 << 16))

    return [_both(step_and_all_reduce) for _ in range(2)]


def test_the_records_give_torchs_peak_on_sharded_ranks():
    for rank, readings in enumerate(run_ranks(_sharded_ranks, 2, timeout_s=300)):
        for fast, reference in readings:
            assert fast == reference, (rank, readings)
