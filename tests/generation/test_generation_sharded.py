"""framework/generation on a sharded model, 2 gloo ranks (one spawn, several cases): greedy tokens
with the cache equal those without it and those of the unsharded model, for our Llama and a
transformers Llama, sharded by our engine, by torch's fully_shard and split by tensor parallelism.
Our engine gathers the model once per call (the bytes of one forward's gathers, not one per
token), so each rank can generate for its own prompts; under FSDP2, whose forwards gather, and with
the experts split over the ranks (expert parallelism), ranks with different prompts and stops still
finish together."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed.harness import passed, recorded, records_of, run_ranks

NEW = 12
PROMPTS = [[5, 17, 3, 9, 11, 2, 40], [7], [60, 1, 22, 8]]
HF_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}


def _model(kind: str):
    from framework.config.schema import ModelConfig
    from framework.models import family_of

    if kind in ("ours", "experts"):
        args = {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48}
        if kind == "experts":  # a mixture of 4 experts per block, 2 a token
            args.update(n_experts=4, top_k=2, moe_ffn_dim=24)
        cfg = ModelConfig(name="debug", args=args)
    else:
        cfg = ModelConfig(name="hf", config=HF_LLAMA)
    family = family_of(cfg)
    torch.manual_seed(0)
    model = family.build(cfg, "cpu")
    family.init_weights(model, 3)
    with torch.no_grad():  # a sharper head: greedy picks far from ties (init_std gives near-uniform logits)
        ours = kind != "transformers"
        head = model.output if ours else model.lm_head
        head.weight.mul_(30 if ours else 1).add_(0 if ours else 0.5 * torch.randn_like(head.weight))
    return cfg, family, model


def _sharded(kind: str, engine: str, tp: int, world: int, ep: int = 1):
    from framework.config.schema import Engine, ParallelismConfig
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize

    cfg, family, model = _model(kind)
    reference = copy.deepcopy(model)
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, tp=tp, world_size=world, ep=ep)
    p = ParallelismConfig(engine=Engine(engine), dp_shard=world // tp, tp=tp, ep=ep)
    return parallelize(model, dims, build_mesh(dims, "cpu"), p, family), reference


def _ids(completions) -> list:
    return [c.token_ids for c in completions]


def _same_everywhere(kind: str, engine: str, tp: int, world: int) -> dict:
    from framework.generation import generate

    model, reference = _sharded(kind, engine, tp, world)
    want = _ids(generate(reference, PROMPTS, NEW))
    out = {
        "cached": _ids(generate(model, PROMPTS, NEW)) == want,
        "recomputed": _ids(generate(model, PROMPTS, NEW, use_cache=False)) == want,
        "distinct": len({tuple(i) for i in want}) == len(want),
    }
    if engine == "native" and tp == 1:
        model.reset_comm_stats()
        with torch.no_grad():
            model(torch.tensor([PROMPTS[0]]))
        one_forward = model.comm_stats()["allgather_bytes"]
        model.reset_comm_stats()
        generate(model, PROMPTS, NEW)
        out.update(one_forward=one_forward, one_call=model.comm_stats()["allgather_bytes"])
    return out


def _own_prompts(engine: str, rank: int, world: int, kind: str = "ours", ep: int = 1) -> dict:
    """Each rank its own prompts: rank 0 three, rank 1 one that stops at its second token (its
    greedy token as end-of-text), in batches of 2: rank 0 runs two batches, rank 1 one. With `ep`
    the experts are split over the ranks: every forward exchanges tokens, so rank 1 keeps stepping
    (its finished row fed the pad id, then a spare batch) while rank 0 decodes ([Note: generation
    with experts split] in framework/generation/__init__.py)."""
    from framework.generation import generate

    model, reference = _sharded(kind, engine, 1, world, ep)
    prompts = PROMPTS if rank == 0 else [PROMPTS[2]]
    eos = [generate(reference, [PROMPTS[2]], 2)[0].token_ids[1]] if rank == 1 else []
    want = _ids(generate(reference, prompts, NEW, eos_ids=eos, batch_size=2))
    got = generate(model, prompts, NEW, eos_ids=eos, batch_size=2)
    return {"same": _ids(got) == want, "reasons": [c.finish_reason for c in got]}


CASES = [
    ("ours_native", "ours", "native", 1),
    ("ours_torch", "ours", "torch", 1),
    ("ours_tp2", "ours", "native", 2),
    ("transformers_native", "transformers", "native", 1),
    ("transformers_tp2", "transformers", "native", 2),
]


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {name: recorded(_same_everywhere, kind, engine, tp, world) for name, kind, engine, tp in CASES}
    for engine in ("native", "torch"):
        out[f"own_prompts_{engine}"] = recorded(_own_prompts, engine, rank, world)
    out["own_prompts_experts_ep2"] = recorded(_own_prompts, "native", rank, world, "experts", 2)
    out["no_prompts_experts_ep2"] = recorded(_no_prompts_on_rank_1, rank, world)
    return out


def _no_prompts_on_rank_1(rank: int, world: int) -> dict:
    """Experts split over 2 ranks, rank 1 with no prompt at all: it still steps with rank 0."""
    from framework.generation import generate

    model, reference = _sharded("experts", "native", 1, world, 2)
    prompts = PROMPTS if rank == 0 else []
    return {"same": _ids(generate(model, prompts, NEW)) == _ids(generate(reference, prompts, NEW))}


def test_a_rank_without_prompts_steps_with_the_others_when_the_experts_are_split(results):
    r = passed(results["no_prompts_experts_ep2"])
    assert r["same"], r


@pytest.fixture(scope="module")
def results():
    return records_of(run_ranks(_worker, 2, timeout_s=300))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_greedy_tokens_on_two_ranks_are_the_unsharded_models_with_and_without_the_cache(results, case):
    r = passed(results[case])
    assert r["distinct"] and r["cached"] and r["recomputed"], r


def test_our_engine_gathers_the_model_once_per_call_not_per_token(results):
    r = passed(results["ours_native"])
    # 3 prompts x 12 tokens: 12 forwards, gathered as one forward's worth
    assert r["one_call"] == r["one_forward"] > 0, r


@pytest.mark.parametrize("engine", ["native", "torch", "experts_ep2"])
def test_ranks_generate_for_their_own_prompts(results, engine):
    r = passed(results[f"own_prompts_{engine}"])
    assert r["same"], r
