"""Would our sharded parameters be better as DTensors with a ragged placement? What it costs and
where torch 2.13 stops it, measured on the benchmark model.

    .venv/bin/python bench/ragged_dtensor.py --out bench/results/ragged_dtensor.json

Each rank's piece of a parameter is a contiguous, possibly empty, range of the flattened
parameter ([Note: flat storage] in framework/distributed/fsdp/flat.py). A `Shard` subclass,
`RaggedShard(bounds)` (rank r holds flattened elements [bounds[r], bounds[r+1])), written here
for the measurement, describes that: `DTensor.from_local(piece, mesh, [RaggedShard(...)])`
shares the piece's storage (no copy), answers `isinstance(p, DTensor)`, `to_local()` and
`full_tensor()` (its `_to_replicate_tensor` gathers the ranges), and torch's AdamW steps it
(its state keeps the placement). Measured, on the 25M GPT, 2 gloo ranks, after one backward:
  1. AdamW's step (for-loop and foreach) over our `ShardPiece`s, over ragged DTensors of the same
     storage, and over plain tensors of it, interleaved call by call (medians of the slower rank);
  2. what torch's own DTensor code makes of the placement: `full_tensor()` against the gathered
     parameter, `distribute_tensor(full, mesh, [RaggedShard])` (what FSDP2's tests compare
     against), and `compute_local_shape_and_global_offset` (what DCP's planner writes).
To pass DTensorSpec's shard-order check a `RaggedShard` must compare equal to `Shard(0)`, so
`redistribute(placements=[Shard(0)])` then returns it unchanged: the hazard is printed too.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import batch, build_gpt, loss_of  # noqa: E402
from framework.local_ranks import run_local  # noqa: E402


class RaggedShard(Shard):
    """Rank r holds elements [bounds[r], bounds[r+1]) of the flattened tensor."""

    def __init__(self, bounds) -> None:
        super().__init__(0)
        self.bounds = tuple(int(b) for b in bounds)

    def __eq__(self, other) -> bool:
        if isinstance(other, RaggedShard):
            return other.bounds == self.bounds
        # DTensorSpec verifies its shard order by comparing each placement with Shard(dim): a
        # subclass must pass as Shard(0) there, and so passes everywhere else too
        return type(other) is Shard and other.dim == 0

    def __hash__(self) -> int:
        return hash((RaggedShard, self.bounds))

    def __repr__(self) -> str:
        return f"RaggedShard({self.bounds})"

    def _split_tensor(self, tensor, num_chunks, *, with_padding=False, contiguous=True):
        flat = tensor.reshape(-1)
        return [flat[self.bounds[r] : self.bounds[r + 1]] for r in range(num_chunks)], []

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        n = len(self.bounds) - 1
        sizes = [self.bounds[r + 1] - self.bounds[r] for r in range(n)]
        send = local_tensor.new_zeros(max(sizes))
        send[: local_tensor.numel()] = local_tensor.reshape(-1)
        recv = local_tensor.new_empty(max(sizes) * n)
        dist.all_gather_into_tensor(recv, send, group=mesh.get_group(mesh_dim))
        parts = [recv[r * max(sizes) : r * max(sizes) + sizes[r]] for r in range(n)]
        return torch.cat(parts).view(current_logical_shape)


def _bounds(e, S: int, N: int) -> list:
    return [min(max(r * S - e.offset, 0), e.numel) for r in range(N + 1)]


def _worker(rank: int, world: int, size: str, repeats: int) -> dict:
    """One rank, in the process group `run_local` made (gloo, one compute thread): its findings."""
    from framework.distributed.fsdp import fully_shard, sharded_units
    from framework.distributed.fsdp.flat import contiguous_stride

    mesh = init_device_mesh("cpu", (world,))
    model = build_gpt(size)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, reshard_after_forward=False)
    idx = batch(size, 0, rank, torch.device("cpu"))
    loss_of(model(idx[:, :-1]), idx).backward()
    pieces = list(model.parameters())
    ragged, plain, specs = [], [], []
    for unit in sharded_units(model):
        L = unit.layout
        for e, p in zip(unit.entries, unit.sharded_params):
            pl = [RaggedShard(_bounds(e, L.shard_numel, L.world))]
            local = p.to_local().detach()
            meta = dict(run_check=False, shape=e.shape, stride=contiguous_stride(e.shape))
            d = torch.nn.Parameter(DTensor.from_local(local, mesh, pl, **meta))
            d.grad = DTensor.from_local(p.grad.to_local(), mesh, pl, **meta)
            q = torch.nn.Parameter(local)
            q.grad = p.grad.to_local()
            ragged.append(d)
            plain.append(q)
            specs.append((unit, e, p))
    same = [d.to_local().data_ptr() == p.to_local().data_ptr() for d, (_, _, p) in zip(ragged, specs)]
    out = {"shares_storage": all(same)}
    # 2. what torch's DTensor code makes of the placement
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full_ok, dist_ok, dcp_ok = 0, 0, 0
    for d, (_, e, p) in zip(ragged, specs):
        whole = p.full_tensor()
        full_ok += bool(torch.equal(d.full_tensor(), whole))
        dist_ok += bool(torch.equal(distribute_tensor(whole, mesh, d.placements).to_local().reshape(-1), d.to_local()))
        shape, _ = compute_local_shape_and_global_offset(e.shape, mesh, d.placements)
        dcp_ok += tuple(shape) == tuple(d.to_local().shape)
    moved = ragged[0].redistribute(mesh, [Shard(0)])
    out.update(
        params=len(ragged),
        full_tensor_equal=full_ok,
        distribute_tensor_equal=dist_ok,
        dcp_local_shape_equal=dcp_ok,
        redistribute_to_shard0_is_noop=moved.to_local().data_ptr() == ragged[0].to_local().data_ptr(),
        redistribute_local_shape=list(moved.to_local().shape),
        shard0_local_shape=list(distribute_tensor(specs[0][2].full_tensor(), mesh, [Shard(0)]).to_local().shape),
    )
    # 1. AdamW's step over the three, interleaved call by call
    for name, kw in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True))):
        opts = {
            "ShardPiece": torch.optim.AdamW(pieces, lr=1e-6, **kw),
            "ragged DTensor": torch.optim.AdamW(ragged, lr=1e-6, **kw),
            "plain tensors": torch.optim.AdamW(plain, lr=1e-6, **kw),
        }
        for opt in opts.values():
            opt.step()  # state allocated outside the timing
        keys = list(opts)
        times = {k: [] for k in keys}
        for i in range(repeats):
            for k in keys[i % len(keys) :] + keys[: i % len(keys)]:
                dist.barrier()
                t = time.perf_counter()
                opts[k].step()
                times[k].append(time.perf_counter() - t)
        for k in keys:
            out[f"{name} {k}"] = times[k]
        out[f"{name} state placement"] = repr(opts["ragged DTensor"].state[ragged[0]]["exp_avg"].placements)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-size", default="25m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the ranks start as main.py starts its own (framework/local_ranks.py), on the CPU: gloo
    results = dict(enumerate(run_local(_worker, args.ranks, args=(args.model_size, args.repeats), timeout_s=3600)))
    r0 = results[0]
    print(f"{args.model_size} GPT, {args.ranks} gloo ranks, {r0['params']} parameters")
    for k in (
        "shares_storage",
        "full_tensor_equal",
        "distribute_tensor_equal",
        "dcp_local_shape_equal",
        "redistribute_to_shard0_is_noop",
        "redistribute_local_shape",
        "shard0_local_shape",
        "foreach state placement",
    ):
        print(f"  {k}: {r0[k]}")
    print("| AdamW step | ShardPiece (ms) | ragged DTensor (ms) | plain tensors (ms) | DTensor / ShardPiece |")
    print("|---|---|---|---|---|")
    summary = {}
    for name in ("for-loop", "foreach"):
        med = {}
        for k in ("ShardPiece", "ragged DTensor", "plain tensors"):
            key = f"{name} {k}"
            med[k] = statistics.median(max(results[r][key][i] for r in results) for i in range(args.repeats))
        ratio = med["ragged DTensor"] / med["ShardPiece"]
        summary[name] = {**med, "ratio": ratio}
        print(
            f"| {name} | {med['ShardPiece'] * 1e3:.1f} | {med['ragged DTensor'] * 1e3:.1f} | "
            f"{med['plain tensors'] * 1e3:.1f} | {ratio:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "ranks": results}, f, indent=1)


if __name__ == "__main__":
    main()
