"""What a sharded module is, as FSDP2's own `test_fully_shard_state.py` checks it (torch's
`test/distributed/_composable/fsdp/`, run on our engine by bench/upstream_fsdp2/run.py), on 2 rank
threads of one process: the class `fully_shard` gives a module, a slice of a sharded container,
`fully_shard.state(module)`, deep-copying a sharded module, sharding one twice, and sharding a
container that has no forward."""

from __future__ import annotations

import copy

import pytest
import torch.nn as nn

from tests.distributed.harness import run_rank_threads

pytestmark = pytest.mark.timeout(300)


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.out_proj(self.in_proj(x).relu())


def _module_api(rank, n):
    from framework.distributed.fsdp import FSDPModule, fully_shard

    out = {}
    model = MLP(8)
    fully_shard(model)
    out["name"] = type(model).__name__
    out["is_mlp_and_fsdp"] = isinstance(model, MLP) and isinstance(model, FSDPModule)
    out["children_plain"] = not any(isinstance(m, FSDPModule) for m in model.modules() if m is not model)

    seq = nn.Sequential(*[MLP(8) for _ in range(3)])
    for mlp in seq:
        fully_shard(mlp)
    fully_shard(seq)
    out["seq_name"] = type(seq).__name__
    sliced = seq[:2]
    out["slice"] = (type(sliced).__name__, isinstance(sliced, FSDPModule), len(sliced))
    out["slice_children_sharded"] = [isinstance(m, FSDPModule) for m in sliced]

    states = [fully_shard.state(seq)] + [fully_shard.state(m) for m in seq]
    out["states"] = (all(s is not None for s in states), len({id(s) for s in states}))
    out["state_of_plain"] = fully_shard.state(nn.Linear(2, 2))

    try:
        fully_shard(model)
        out["twice"] = "sharded again"
    except AssertionError as e:  # FSDP2's type; ours is also the ValueError of every refusal
        out["twice"] = (isinstance(e, ValueError), str(e))
    out["containers"] = []
    for container in (nn.ModuleList([MLP(8)]), nn.ModuleDict({"a": MLP(8)})):
        try:
            fully_shard(container)
            out["containers"].append("sharded")
        except ValueError as e:
            out["containers"].append(str(e).split(":")[0])
    try:
        copy.deepcopy(model)
        out["deepcopy"] = "copied"
    except AssertionError as e:
        out["deepcopy"] = str(e)
    return out


def test_sharded_module_class_slices_state_and_deepcopy():
    for run in run_rank_threads(_module_api, 2):
        for out in run:
            assert out["name"] == "FSDPMLP" and out["seq_name"] == "FSDPSequential"  # FSDP2's names
            assert out["is_mlp_and_fsdp"] and out["children_plain"]
            # a slice of a sharded Sequential is a plain Sequential over the (sharded) members
            assert out["slice"] == ("Sequential", False, 2)
            assert out["slice_children_sharded"] == [True, True]
            assert out["states"] == (True, 4)  # one distinct state per fully_shard call
            assert out["state_of_plain"] is None
            twice_is_value_error, twice = out["twice"]
            assert twice_is_value_error and twice.startswith(
                "Each distinct composable distributed API can only be applied to a module once. "
                "fully_shard: FSDPMLP is already sharded"
            )
            # a container without forward would never be gathered: refused, as FSDP2 does
            assert out["containers"] == ["fully_shard does not support containers that do not implement forward"] * 2
            assert out["deepcopy"].startswith("FSDP does not support deepcopy: FSDPMLP is sharded;")
