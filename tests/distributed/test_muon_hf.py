"""Muon on a Hugging Face Llama (a tiny transformers `LlamaConfig` built here, nothing downloaded)
sharded by our engine on 1, 2 and 4 gloo ranks, under each shard-boundary policy, against one
process with the same parameter groups: the groups `build_optimizer` makes from the model as built
(Muon: every decoder layer's q/k/v/o and gate/up/down projections; AdamW: the embedding, the norms
and the output head), 1e-5 in the losses and every weight after 10 steps.

Tolerances as tests/distributed/test_muon.py says, for the same reason: torch's Muon runs its
Newton-Schulz iteration in bfloat16, where the sharded gradients' fp32 summation order flips
roundings (here already on 2 ranks: 6.0e-5 in the loss, 5.4e-3 in a weight after 10 steps). So one
rank is compared with torch's `torch.optim.Muon` + `torch.optim.AdamW` in bfloat16 (bit for bit
there), and 2 and 4 ranks run the float32 iteration against the same optimizer on one process;
so does dp_shard 2 x tp 2 (transformers' own tp plan, as `main.py` applies it: each q/k/v/o and
gate/up/down matrix split over tp and made whole over dp and tp by [Note: whole matrices from
pieces] in framework/distributed/fsdp/whole.py), under each shard-boundary policy.

One 4-rank spawn runs every case (importing transformers in a rank is the slow part): a case on
n ranks runs on each group of n consecutive ranks (the shard dim of a (4/n, n) mesh) at once:
building a sharded model is collective over every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed.harness import passed, recorded, records_of, run_ranks

STEPS = 10
ROWS, SEQ, VOCAB = 8, 12, 128
TOL = 1e-5
BOUNDARIES = ["anywhere", "rows", "params"]
LLAMA = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)


def _model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).float()


def _optimizer_cfg():
    from framework.config.schema import OptimizerConfig

    return OptimizerConfig(name="muon", lr=3e-3, muon_lr=0.02, weight_decay=0.1, warmup_steps=0)


def _batch(step: int, rank: int, n: int):
    idx = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(300 + step))
    k = ROWS // n
    return idx[rank * k : (rank + 1) * k]


def _loss(model, idx):
    logits = model(input_ids=idx[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), idx[:, 1:].reshape(-1))


def _reference(model, ns_dtype):
    """Losses and final weights on one process: torch's Muon + AdamW over `build_optimizer`'s groups
    (bfloat16), or our optimizer with the iteration in float32."""
    from tests.distributed.muon_reference import reference_optimizers

    cfg = _optimizer_cfg()
    opts = reference_optimizers(model, cfg, ns_dtype)
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step, 0, 1))
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(n: int, boundary: str, ns_dtype, initial, ref) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from framework.distributed.fsdp import fully_shard
    from framework.optim import build_optimizer, hidden_matrix_names, no_decay_names

    mesh = init_device_mesh("cpu", (4 // n, n), mesh_dim_names=("copies", "shard"))["shard"]
    rank, group = mesh.get_local_rank(), mesh.get_group()
    model = copy.deepcopy(initial)
    hidden, undecayed = hidden_matrix_names(model), no_decay_names(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_boundary=boundary)
    fully_shard(model, mesh=mesh, shard_boundary=boundary)
    opt = build_optimizer(model, _optimizer_cfg(), undecayed=undecayed, hidden=hidden)
    opt.ns_dtype = ns_dtype
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step, rank, n))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / n)
    ref_losses, want = ref
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    start = initial.state_dict()
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "weight_diff": max((want[k] - got[k]).abs().max().item() for k in want),
        "moved": max((want[k] - start[k]).abs().max().item() for k in hidden),
        "muon": len(hidden),
    }


def _tp_split(piece) -> bool:
    """Whether the unit entry behind a shard piece is a tensor-parallel slice of its matrix."""
    unit, index = piece.piece_spec.owner()
    tp = unit.entries[index].tp
    return tp is not None and any(pl.is_shard() for pl in tp.placements)


def _run_tp(boundary: str, initial, ref) -> dict:
    """dp_shard 2 x tp 2 over the 4 ranks, as `main.py` builds it (`parallelize` with the model=hf
    family: transformers' own tp plan, then our sharding per decoder layer and at the root); each dp
    rank takes its half of the batch, the Newton-Schulz iteration in float32."""
    import torch.distributed as dist

    from framework.config.schema import ParallelismConfig, ShardBoundary, Strategy
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.distributed.tensor_parallel import full, loss_context
    from framework.models.hf.family import FAMILY as HF
    from framework.optim import build_optimizer, hidden_matrix_names, no_decay_names

    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, world_size=4)
    mesh = build_mesh(dims, "cpu")
    model = copy.deepcopy(initial)
    hidden, undecayed = hidden_matrix_names(model), no_decay_names(model)
    cfg = ParallelismConfig(strategy=Strategy.full, dp_shard=2, tp=2, shard_boundary=ShardBoundary(boundary))
    model = parallelize(model, dims, mesh, cfg, HF)
    opt = build_optimizer(model, _optimizer_cfg(), undecayed=undecayed, hidden=hidden)
    opt.ns_dtype = torch.float32
    dp_rank, dp_group = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].get_group()
    losses = []
    for step in range(STEPS):
        with loss_context(model):  # the logits stay sharded on the vocabulary
            loss = _loss(model, _batch(step, dp_rank, 2))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = full(loss.detach()).clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / 2)
    ref_losses, want = ref
    got = {k: full(v).detach() for k, v in model.state_dict().items()}
    start = initial.state_dict()
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "weight_diff": max((want[k] - got[k]).abs().max().item() for k in want),
        "moved": max((want[k] - start[k]).abs().max().item() for k in hidden),
        "muon": len(hidden),
        "tp_split": sum(1 for k, p in model.named_parameters() if k in hidden and _tp_split(p)),
    }


# Every policy on 4 ranks (one rank holds every matrix whole whatever the policy; test_muon.py
# covers each policy on 2 ranks too), and on dp_shard 2 x tp 2
CASES = [(1, "anywhere"), (2, "anywhere")] + [(4, b) for b in BOUNDARIES]
TP_CASES = BOUNDARIES


def _cases(rank: int, world: int) -> dict:
    initial = _model()
    refs = {dt: _reference(copy.deepcopy(initial), dt) for dt in (torch.bfloat16, torch.float32)}
    out = {}
    for n, b in CASES:
        dtype = torch.bfloat16 if n == 1 else torch.float32
        out[f"{n}-{b}"] = recorded(_run, n, b, dtype, initial, refs[dtype])
    for b in TP_CASES:
        out[f"dp2xtp2-{b}"] = recorded(_run_tp, b, initial, refs[torch.float32])
    return out


@pytest.fixture(scope="module")
def hf_llama():
    return records_of(run_ranks(_cases, 4, timeout_s=300))


@pytest.mark.parametrize("n, boundary", CASES)
def test_muon_on_a_hugging_face_llama_equals_one_process(hf_llama, n, boundary):
    """1 rank: torch's Muon + AdamW (bfloat16); 2 and 4 ranks: the same optimizer on one process
    (float32 iteration); 1e-5 in the losses and every weight after 10 steps."""
    r = passed(hf_llama[f"{n}-{boundary}"])
    assert r["muon"] == 2 * 7, r  # q, k, v, o, gate, up, down of each layer
    assert r["loss_diff"] < TOL and r["weight_diff"] < TOL, r
    assert r["moved"] > 0.01, r  # Muon moved the matrices: the comparison means something


@pytest.mark.parametrize("boundary", TP_CASES)
def test_muon_on_a_hugging_face_llama_on_dp2_tp2_equals_one_process(hf_llama, boundary):
    """dp_shard 2 x tp 2 (transformers' tp plan): every Muon matrix split over tp, made whole over
    dp and tp; the same optimizer on one process (float32 iteration), 1e-5 in the losses and every
    weight after 10 steps."""
    r = passed(hf_llama[f"dp2xtp2-{boundary}"])
    print(f"dp2xtp2 {boundary}: max loss diff {r['loss_diff']:.2g}, max weight diff {r['weight_diff']:.2g}")
    assert r["muon"] == r["tp_split"] == 2 * 7, r  # each q, k, v, o, gate, up, down split over tp
    assert r["loss_diff"] < TOL and r["weight_diff"] < TOL, r
    assert r["moved"] > 0.01, r
