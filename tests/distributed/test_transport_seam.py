"""The engine's transport seam ([Note: one transport per group] in framework/distributed/fsdp/
transport.py): every group's transport (the gathers', the reductions') is chosen by the first
forward, so no backward, optimizer step or later step (nor the gradient pool sizing its
buffers) ever chooses one, which would be a collective at a time the data decides; and each
collective's profiler label names its unit by its path in the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.timeout(300)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _worker(rank, world, transport):
    from torch.profiler import ProfilerActivity, profile

    from framework.distributed.fsdp import collectives as C
    from framework.distributed.fsdp import fully_shard, set_host_transport

    set_host_transport(transport)
    torch.manual_seed(0)
    model = _Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    chosen_at_step = []

    def refuse(group, device):  # a transport chosen after lazy init would land here
        chosen_at_step.append(True)
        raise AssertionError("a transport was chosen during a step")

    real = C.host_transport
    names = set()
    try:
        for _ in range(3):
            idx = torch.randint(0, 64, (4, 9), generator=g)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = model(idx[:, :-1])  # the first: lazy init chooses every transport, then gathers
                C.host_transport = refuse  # from here on, choosing one fails the step
                F.cross_entropy(out.reshape(-1, 64), idx[:, 1:].reshape(-1)).backward()
                opt.step()
                opt.zero_grad()
            names |= {e.name for e in prof.events() if e.name.startswith("fsdp::")}
    finally:
        C.host_transport = real
    units = model._fsdp_unit.ctx.units
    kinds = sorted({t.name for u in units for t in u.transports()[:2]})
    return {"chosen_at_step": chosen_at_step, "names": sorted(names), "kinds": kinds}


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_transports_are_chosen_at_lazy_init_and_labels_name_units(transport):
    for res in run_ranks(_worker, 2, args=(transport,), timeout_s=240):
        assert res["chosen_at_step"] == []
        assert res["kinds"] == [transport]  # every unit's gather and reduction groups took it
        for unit in ("blocks.0", "blocks.1", "_Net"):
            assert f"fsdp::all_gather({unit})" in res["names"], res["names"]
        assert "fsdp::reduce_scatter(blocks.0)" in res["names"], res["names"]
