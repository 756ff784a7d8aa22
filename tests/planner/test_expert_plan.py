"""The planner's expert parallelism against the running engine on 4 gloo ranks.

A small mixture-of-experts Llama (4 experts, each token routed to all 4: the routing then spreads
rows over the ep ranks exactly as evenly as the planner assumes, whatever the router learns) runs
with ep=2 (efsdp=2), ep=4 and ep=2 with full activation checkpointing and gradient accumulation;
per rank, one step's bytes and exchanges of the model's all-to-alls (`AllToAllCounter`: token rows,
their gradients, row counts) equal the planner's `all_to_all` row on the `ep` dimension, and the
engine's own counters (`comm_stats()`: the dense units over dp_shard, the experts over efsdp)
equal the planner's engine rows.
"""

from __future__ import annotations

import pytest
import torch

from framework.config.schema import ClusterConfig, Config, DataConfig, ModelConfig, ParallelismConfig, TrainerConfig
from framework.planner import job_from_config
from framework.planner.estimate import traffic
from tests.distributed.harness import run_ranks

MODEL = {
    "vocab_size": 256,
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 64,
    "max_seq_len": 16,
    "n_experts": 4,
    "top_k": 4,
    "moe_ffn_dim": 32,
    "n_shared_experts": 1,
}
# transformers' DeepSeek-V3 at a tiny size (built locally): MLA attention, a shared expert, the
# first block dense (no experts, no all-to-all), every token routed to all 4 experts
DEEPSEEK = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "qk_nope_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "tie_word_embeddings": False,
}
SEQ, MICRO = 16, 2
CASES = {  # name: (parallelism overrides, micro-batches per step)
    "ep2": ({"ep": 2}, 1),
    "ep4": ({"ep": 4}, 1),
    "ep2_ckpt_accum": ({"ep": 2, "activation_checkpointing": "full"}, 2),
    "hf_deepseek_ep2": ({"ep": 2}, 1),
}


def _config(name: str) -> Config:
    over, accum = CASES[name]
    if name.startswith("hf_"):
        model = ModelConfig(name="hf", config=DEEPSEEK, args={"max_seq_len": SEQ})
    else:
        model = ModelConfig(name="moe_debug", args=MODEL)
    return Config(
        model=model,
        parallelism=ParallelismConfig(strategy="full", dp_shard=4, **over),
        data=DataConfig(name="synthetic", seq_len=SEQ),
        trainer=TrainerConfig(micro_batch_size=MICRO, global_batch_size=MICRO * 4 * accum),
        cluster=ClusterConfig(nodes=1, nproc_per_node=4),
    )


def _step(model, opt, g, accum: int) -> None:
    import torch.nn.functional as F

    for micro in range(accum):
        model.set_requires_gradient_sync(micro == accum - 1)  # as the trainer accumulates
        tokens = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)  # transformers' output
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _worker(rank: int, world: int, names):
    from framework.config.validate import parallel_dims_of
    from framework.distributed.expert_parallel import AllToAllCounter
    from framework.distributed.parallel_dims import build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.models import family_of
    from framework.models.hf.model import build_hf
    from framework.models.llama import build_llama

    out = {}
    for name in names:
        cfg = _config(name)
        dims = parallel_dims_of(cfg, world)
        mesh = build_mesh(dims, "cpu")
        torch.manual_seed(0)
        if name.startswith("hf_"):
            model = build_hf(cfg.model)
        else:
            model = build_llama(cfg.model)
            model.init_weights(0)
        model = parallelize(model, dims, mesh, cfg.parallelism, family_of(cfg.model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        g = torch.Generator().manual_seed(rank)

        _step(model, opt, g, CASES[name][1])
        model.reset_comm_stats()
        AllToAllCounter.reset()
        _step(model, opt, g, CASES[name][1])
        stats = model.comm_stats()
        out[name] = {
            "comm": {k: v for k, v in stats.items() if k.endswith("_bytes") or k == "num_collectives"},
            "a2a": (AllToAllCounter.bytes_sent, AllToAllCounter.calls),
        }
    return out


@pytest.fixture(scope="module")
def engine_results():
    return run_ranks(_worker, 4, args=(list(CASES),), timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_all_to_all_matches_engine(engine_results, name):
    job = job_from_config(_config(name))
    tr = traffic(job)
    ep_rows = [r for r in tr.rows if r["dim"] == "ep"]
    assert len(ep_rows) == 1 and ep_rows[0]["collective"] == "all_to_all", tr.rows
    for rank, res in enumerate(engine_results):
        got = res[name]
        # Exact: top_k = n_experts sends every row to every expert, so (ep-1)/ep of them leave.
        assert (ep_rows[0]["bytes"], ep_rows[0]["calls"]) == tuple(got["a2a"]), (name, rank)
        assert tr.engine_counters() == got["comm"], (name, rank)


def test_pipeline_proposed_where_the_family_cuts_experts_into_stages():
    """A transformers MoE is cut into stages by its family (framework/models/hf/pipeline.py
    accepts it) and its experts split inside them at ep > 1, as our Llama's: where sharding alone
    does not fit the planner proposes pp for both at ep=1 and ep=2, each stage's dp_shard a
    multiple of ep."""
    from dataclasses import replace

    from framework.planner.estimate import memory
    from framework.planner.pipeline import propose_pipeline

    hf = replace(job_from_config(_config("hf_deepseek_ep2")), ep=1)
    assert hf.model.n_experts == 4 and hf.model.pipeline
    tight = replace(hf, memory_gib=0.9 * memory(hf).peak / 2**30)  # sharding alone misses by 10%
    assert hf.model.pipeline_experts
    assert propose_pipeline(tight) is not None
    proposal = propose_pipeline(replace(tight, ep=2))
    assert proposal is not None and proposal.dp_shard % 2 == 0
    llama = job_from_config(_config("ep2"))
    assert llama.model.pipeline and llama.model.pipeline_experts and llama.ep == 2
    for ep in (1, 2):
        job = replace(llama, ep=ep, model=replace(llama.model, tie_embeddings=False))
        proposal = propose_pipeline(replace(job, memory_gib=0.9 * memory(job).peak / 2**30))
        assert proposal is not None and proposal.dp_shard % ep == 0, ep


def test_advice_splits_the_experts_where_that_fits():
    """A mixture of experts that misses its memory with every rank gathering whole blocks of
    experts: the advice names parallelism.ep (the experts' gathers then cover 1/ep of them), and
    the job with it fits."""
    from dataclasses import replace

    from framework.planner.estimate import memory
    from framework.planner.plan import advise

    job = replace(job_from_config(_config("ep2")), ep=1, param_dtype="bfloat16")
    split = memory(replace(job, ep=4)).peak
    assert split < memory(job).peak
    tight = replace(job, memory_gib=split / 2**30)
    changes = advise(tight)
    eps = [c for c in changes if any(o.startswith("parallelism.ep=") for o in c.overrides)]
    assert eps and all(c.estimate.fits for c in eps), [c.overrides for c in changes]
