"""Muon with tensor parallelism: `optimizer=muon` on a dp_shard 2 x tp 2 mesh (4 gloo ranks) and
the debug Llama, against torch's `torch.optim.Muon` + `torch.optim.AdamW` on one process with the
same parameter groups ([Note: whole matrices from pieces] in framework/distributed/fsdp/whole.py),
under each shard-boundary policy; and the whole-matrix traffic of a step against its theory.

One 4-rank spawn runs every case (starting ranks is the slow part)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import passed, recorded, records_of, run_ranks

BOUNDARIES = ["anywhere", "rows", "params"]
STEPS = 10
# Tolerances. Tensor parallelism sums each row-parallel matmul in two partial products plus an
# all-reduce, so the gradients differ from one process's in their last fp32 bits (~1e-7
# relative), as data parallelism's reduction order does (tests/distributed/test_muon.py's TOL).
# So dp2 x tp2 is compared at 1e-5 with the Newton-Schulz iteration in float32, against the same
# optimizer on one process (which equals torch's Muon bit for bit in bfloat16 on one process:
# test_muon.py, n=1). In bfloat16 (torch's Muon's arithmetic) one flipped rounding of the
# iteration's input changes its output by up to ~2% of its largest entry (a 64 x 176 matrix, 1e-6
# relative noise on the input: 0.0049 of 0.27), which 10 steps of lr 0.02 carry to 3.1e-3 in a
# Muon matrix, 1.4e-4 in the loss, and (AdamW normalizes the embedding rows' tiny gradients) 9.7e-3
# in the embedding, for every boundary policy alike: torch's own Muon + AdamW is compared at
# TORCH_TOL, about three times those.
TOL = 1e-5
TORCH_TOL = {"loss": 5e-4, "muon_weights": 1e-2, "weights": 3e-2}


def _optimizer_cfg():
    from framework.config.schema import OptimizerConfig

    return OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02, weight_decay=0.1, warmup_steps=0)


def _reference(ns_dtype: torch.dtype):
    """Losses and final weights of one process: torch's Muon + AdamW over the groups
    `build_optimizer` makes (bfloat16), or our optimizer with the iteration in float32."""
    from framework.models.llama import build_llama
    from framework.models.tasks import cross_entropy as loss_fn
    from tests.distributed.muon_reference import reference_optimizers
    from tests.tp.tp_cases import MODEL, SEED, batches

    torch.manual_seed(SEED)
    model = build_llama(MODEL)
    model.init_weights(seed=SEED)
    cfg = _optimizer_cfg()
    opts = reference_optimizers(model, cfg, ns_dtype)
    losses = []
    for inputs, labels in batches(MODEL.args["vocab_size"])[:STEPS]:
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def whole_bytes_theory(model, hidden) -> dict:
    """A step's whole-matrix traffic on this rank by [Note: whole matrices from pieces], from each
    matrix's dp owner (`assign_owners`: [Note: balancing whole-matrix owners], in the layout's
    order: the units' module order, then offsets): over dp, the all-to-alls send this rank's pieces
    of the matrices others own and, of those it owns, every other rank's piece back (x4); over tp,
    one fp32 all-gather ((T-1) x M x 4 received) and one reduce-scatter ((T-1) x M x 4 sent) of the
    tp-local slices of the tp-split matrices this rank's dp index owns (M elements)."""
    import torch.distributed as dist

    from framework.distributed.whole_owners import assign_owners, holdings, newton_schulz_flops

    found = []
    for name, p in model.named_parameters():
        if name in hidden:
            unit, index = p.piece_spec.owner()
            found.append((unit.ctx.units.index(unit), unit.entries[index].offset, unit, unit.entries[index]))
    found.sort(key=lambda f: f[:2])
    L = found[0][2].layout
    held = [holdings(e.offset, e.numel, unit.layout.shard_numel, L.world) for _, _, unit, e in found]
    costs = [newton_schulz_flops(e.tp.shape if e.tp is not None else e.shape) for *_, e in found]
    owners = assign_owners(costs, held, L.world)
    dp_bytes = M = 0
    for h, o, (*_, e) in zip(held, owners, found):
        for r, n in h.items():
            if r != o and L.rank in (r, o):
                dp_bytes += n * 4
        if o == L.rank and e.tp is not None and any(pl.is_shard() for pl in e.tp.placements):
            M += e.numel
    T = dist.get_world_size(found[0][3].tp.mesh.get_group())
    return {"dp": dp_bytes, "tp": (T - 1) * M * 4}


def _run(boundary: str, ns_dtype: torch.dtype, ref) -> dict:
    import torch.distributed as dist

    from framework.config.schema import ParallelismConfig, ShardBoundary, Strategy
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.distributed.tensor_parallel import full, loss_context
    from framework.models.llama import FAMILY as LLAMA
    from framework.models.llama import build_llama
    from framework.models.tasks import cross_entropy as loss_fn
    from framework.optim import build_optimizer, hidden_matrix_names, no_decay_names
    from tests.tp.tp_cases import MODEL, SEED, batches

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=4)
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(SEED)
    model = build_llama(MODEL)
    model.init_weights(seed=SEED)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hidden, undecayed = hidden_matrix_names(model), no_decay_names(model)
    cfg = ParallelismConfig(strategy=Strategy.full, dp_shard=2, tp=2, shard_boundary=ShardBoundary(boundary))
    model = parallelize(model, dims, mesh, cfg, LLAMA)
    opt = build_optimizer(model, _optimizer_cfg(), undecayed=undecayed, hidden=hidden)
    opt.ns_dtype = ns_dtype
    dp_rank = mesh["dp_shard"].get_local_rank()
    losses, whole = [], None
    for inputs, labels in batches(MODEL.args["vocab_size"])[:STEPS]:
        rows = slice(2 * dp_rank, 2 * dp_rank + 2)
        with loss_context(model):
            loss = loss_fn(model(inputs[rows]), labels[rows])
            loss.backward()
        value = full(loss.detach()).clone()
        dist.all_reduce(value, group=mesh["dp_shard"].get_group())
        losses.append(value.item() / 2)
        model.reset_comm_stats()
        opt.step()  # the optimizer step's traffic alone: the whole matrices'
        whole = model.comm_stats()
        opt.zero_grad(set_to_none=True)
    ref_losses, ref_weights = ref
    weights = {k: full(v).detach() for k, v in model.state_dict().items()}
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "weight_diff": max((ref_weights[k] - weights[k]).abs().max().item() for k in ref_weights),
        "hidden_diff": max((ref_weights[k] - weights[k]).abs().max().item() for k in hidden),
        "moved": max((weights[k] - initial[k]).abs().max().item() for k in hidden),
        "gathered": whole["allgather_bytes"],
        "scattered": whole["reduce_scatter_bytes"],
        "exchanged": whole["alltoall_bytes"],
        "theory": whole_bytes_theory(model, hidden),
    }


def _cases(rank: int, world: int) -> dict:
    refs = {dt: _reference(dt) for dt in (torch.float32, torch.bfloat16)}
    out = {}
    for boundary in BOUNDARIES:
        out[boundary] = recorded(_run, boundary, torch.float32, refs[torch.float32])
    out["torch"] = recorded(_run, "anywhere", torch.bfloat16, refs[torch.bfloat16])  # the policy changes nothing here
    return out


@pytest.fixture(scope="module")
def dp2_tp2():
    return run_ranks(_cases, 4, timeout_s=400)  # every rank's records: the traffic differs by dp index


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_muon_on_dp2_tp2_equals_one_process(dp2_tp2, boundary):
    """10 steps on dp_shard 2 x tp 2, Newton-Schulz in float32: the losses and every weight of the
    same optimizer on one process to 1e-5; each tp-split matrix made whole over dp and tp, and the
    optimizer step's traffic the stated theory on every rank."""
    r = passed(records_of(dp2_tp2)[boundary])
    assert r["loss_diff"] < TOL and r["weight_diff"] < TOL, r
    assert r["moved"] > 0.01, r  # Muon moved the matrices: the comparison means something
    for rank, records in enumerate(dp2_tp2):
        r = records[boundary]
        theory = r["theory"]
        print(f"{boundary}, rank {rank}: optimizer step bytes sent over dp {theory['dp']}, over tp {theory['tp']}")
        assert r["exchanged"] == theory["dp"], (rank, r)
        assert r["gathered"] == r["scattered"] == theory["tp"], (rank, r)
    assert all(records[boundary]["theory"]["tp"] > 0 for records in dp2_tp2)  # tp-split matrices gathered over tp


def test_muon_on_dp2_tp2_tracks_torch_muon(dp2_tp2):
    """The same in bfloat16 against torch's Muon + AdamW on one process: within TORCH_TOL (see the
    tolerances at the top)."""
    r = passed(records_of(dp2_tp2)["torch"])
    assert r["loss_diff"] < TORCH_TOL["loss"], r
    assert r["hidden_diff"] < TORCH_TOL["muon_weights"] and r["weight_diff"] < TORCH_TOL["weights"], r
    assert r["moved"] > 0.01, r
