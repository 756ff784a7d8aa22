"""Weight decay leaves norms, embeddings, biases and 1-D parameters alone, decided by what each
parameter is (its module's type, its shape as built), for our models and every Hugging Face
family we support ([Note: what weight decay leaves alone] in framework/optim/builder.py), and the
decision holds after the engine has turned the parameters into 1-D pieces or DTensors."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from tests.hf.test_hf_families import FAMILIES


def _expand(*patterns: str) -> set:
    """`"h.0.{ln_1,ln_2}.{weight,bias}"` -> the four names."""
    names = set()
    for pattern in patterns:
        parts = re.split(r"\{([^}]*)\}", pattern)
        choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
        names |= {"".join(c) for c in itertools.product(*choices)}
    return names


LLAMA_LIKE = _expand(
    "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.{input,post_attention}_layernorm.weight"
)
QKV_BIAS = _expand("model.layers.0.self_attn.{q,k,v}_proj.bias")
# The parameters weight decay leaves alone, each family built with one layer (or one per stack).
# A head tied to the embedding is the embedding (both names).
NO_DECAY = {
    "gpt2": _expand(
        "transformer.{wte,wpe}.weight",
        "lm_head.weight",
        "transformer.h.0.{ln_1,ln_2}.{weight,bias}",
        "transformer.ln_f.{weight,bias}",
        "transformer.h.0.attn.{c_attn,c_proj}.bias",
        "transformer.h.0.mlp.{c_fc,c_proj}.bias",
    ),
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "gemma": LLAMA_LIKE | {"lm_head.weight"},
    "gemma2": LLAMA_LIKE | {"lm_head.weight"} | _expand("model.layers.0.{pre,post}_feedforward_layernorm.weight"),
    "phi3": LLAMA_LIKE,
    "gpt_neox": _expand(
        "gpt_neox.embed_in.weight",
        "gpt_neox.final_layer_norm.{weight,bias}",
        "gpt_neox.layers.0.{input,post_attention}_layernorm.{weight,bias}",
        "gpt_neox.layers.0.attention.{query_key_value,dense}.bias",
        "gpt_neox.layers.0.mlp.{dense_h_to_4h,dense_4h_to_h}.bias",
    ),
    "opt": _expand(
        "model.decoder.{embed_tokens,embed_positions}.weight",
        "lm_head.weight",
        "model.decoder.final_layer_norm.{weight,bias}",
        "model.decoder.layers.0.{self_attn_layer_norm,final_layer_norm}.{weight,bias}",
        "model.decoder.layers.0.self_attn.{q,k,v,out}_proj.bias",
        "model.decoder.layers.0.{fc1,fc2}.bias",
    ),
    "qwen2": LLAMA_LIKE | QKV_BIAS,
    "qwen3": LLAMA_LIKE | _expand("model.layers.0.self_attn.{q,k}_norm.weight"),
    "mixtral": LLAMA_LIKE,
    "qwen2_moe": LLAMA_LIKE | QKV_BIAS,
    "bert_classify": _expand(
        "bert.embeddings.{word,position,token_type}_embeddings.weight",
        "bert.embeddings.LayerNorm.{weight,bias}",
        "bert.encoder.layer.0.{attention.output,output}.LayerNorm.{weight,bias}",
        "bert.encoder.layer.0.attention.self.{query,key,value}.bias",
        "bert.encoder.layer.0.{attention.output,intermediate,output}.dense.bias",
        "bert.pooler.dense.bias",
        "classifier.bias",
    ),
    "bart": _expand(
        "model.shared.weight",
        "lm_head.weight",
        "model.{encoder,decoder}.{embed_tokens,embed_positions}.weight",
        "model.{encoder,decoder}.layernorm_embedding.{weight,bias}",
        "model.{encoder,decoder}.layers.0.{self_attn_layer_norm,final_layer_norm}.{weight,bias}",
        "model.{encoder,decoder}.layers.0.self_attn.{q,k,v,out}_proj.bias",
        "model.{encoder,decoder}.layers.0.{fc1,fc2}.bias",
        "model.decoder.layers.0.encoder_attn_layer_norm.{weight,bias}",
        "model.decoder.layers.0.encoder_attn.{q,k,v,out}_proj.bias",
    ),
    "mt5": _expand(
        "shared.weight",
        "lm_head.weight",
        "{encoder,decoder}.embed_tokens.weight",
        "{encoder,decoder}.final_layer_norm.weight",
        "{encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "encoder.block.0.layer.{0,1}.layer_norm.weight",
        "decoder.block.0.layer.{0,1,2}.layer_norm.weight",
    ),
}
OUR_LLAMA = _expand("tok_embeddings.weight", "norm.weight", "layers.{0,1}.{attention_norm,ffn_norm}.weight")
OURS = {  # our presets, as configured (conf/model/*.yaml)
    "debug": OUR_LLAMA,
    "moe_debug": OUR_LLAMA | {"output.weight"},  # tied to the embedding
    "digits_cnn": _expand("layers.{0,1}.conv.bias", "layers.2.fc.bias", "head.bias"),
}
ONE_LAYER = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")


def _groups(model) -> tuple:
    """(names in the decayed group, names in the group without decay) of build_optimizer's
    AdamW with weight_decay=0.1; every trainable parameter is in exactly one."""
    from framework.config.schema import OptimizerConfig
    from framework.optim import build_optimizer

    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert not decayed & plain and decayed | plain == set(names.values())
    return decayed, plain


def _tied_names(model) -> dict:
    """name -> every name of the same parameter (a head tied to the embedding has two)."""
    by_param: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), set()).add(name)
    return {n: names for names in by_param.values() for n in names}


def test_every_family_listed():
    assert set(NO_DECAY) == set(FAMILIES)


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_hugging_face_family_no_decay_set(label):
    from framework.config.schema import ModelConfig
    from framework.models import family_of

    model_type, config, task = FAMILIES[label]
    config = {k: (1 if k in ONE_LAYER else v) for k, v in config.items()}
    cfg = ModelConfig(name="hf", config=dict(config, model_type=model_type), task=task, args={"max_seq_len": 64})
    model = family_of(cfg).build(cfg, "meta")
    decayed, plain = _groups(model)
    tied = _tied_names(model)
    # The optimizer lists a tied parameter once, under its first name; the set names both.
    assert set().union(*(tied[n] for n in plain)) == NO_DECAY[label], label
    assert all(p.dim() >= 2 for n, p in model.named_parameters() if n in decayed)


@pytest.mark.parametrize("preset", sorted(OURS))
def test_our_model_no_decay_set(preset):
    from framework.config import compose_config, to_config
    from framework.models import family_of

    cfg = to_config(compose_config([f"model={preset}"])).model
    family = family_of(cfg)
    model = family.build(family.with_vocab_size(cfg, 256), "meta")
    _, plain = _groups(model)
    tied = _tied_names(model)
    assert set().union(*(tied[n] for n in plain)) == OURS[preset]


def _sharded_groups(rank, world, run_dir):
    """The trainer's own optimizer after parallelize, per layout: names in the group without decay,
    and whether the engine's pieces were 1-D (the shape weight decay must not be judged by)."""
    from framework.config import compose_config, to_config
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    layouts = {
        "native": [],
        "torch": ["parallelism.engine=torch"],
        "tp2": ["parallelism.tp=2", "parallelism.dp_shard=1"],
    }
    out = {}
    for label, extra in layouts.items():
        overrides = ["model=debug", "data=synthetic", "optimizer.weight_decay=0.1", "checkpoint.save_final=false"]
        cfg = to_config(compose_config(overrides + extra))
        cfg.run_dir = f"{run_dir}/{label}"
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        groups = trainer.optimizer.param_groups
        out[label] = {
            "plain": sorted(names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]),
            "decayed": sorted(names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]),
            "decayed_dims": sorted({p.dim() for g in groups if g["weight_decay"] > 0 for p in g["params"]}),
        }
        if trainer.ckpt is not None:
            trainer.ckpt.close()
        del trainer
    return out


def test_the_decision_holds_after_sharding_and_tensor_parallel(tmp_path):
    from tests.distributed.harness import run_ranks

    results = run_ranks(_sharded_groups, world_size=2, args=(str(tmp_path),), timeout_s=300)
    for rank, result in enumerate(results):
        for label, groups in result.items():
            assert set(groups["plain"]) == OUR_LLAMA, (rank, label, groups)
            assert len(groups["decayed"]) == 15 and not set(groups["decayed"]) & OUR_LLAMA, (rank, label, groups)
        # Our engine's pieces are 1-D, decayed matrices included: judged by shape there, every
        # matrix would have lost its decay.
        assert result["native"]["decayed_dims"] == [1], result["native"]


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_hugging_face_family_muon_matrices(label):
    """optimizer=muon's matrices ([Note: Muon on sharded matrices]) are exactly the blocks'
    decayed matrices (and BERT's pooler, a hidden matrix outside them): no embedding, norm, bias,
    position table or output head (whose rows are the vocabulary), in every Hugging Face family
    we support."""
    from framework.config.schema import ModelConfig
    from framework.models import family_of
    from framework.optim import hidden_matrix_names

    model_type, config, task = FAMILIES[label]
    config = {k: (1 if k in ONE_LAYER else v) for k, v in config.items()}
    cfg = ModelConfig(name="hf", config=dict(config, model_type=model_type), task=task, args={"max_seq_len": 64})
    model = family_of(cfg).build(cfg, "meta")
    in_blocks = {
        n
        for n, p in model.named_parameters(remove_duplicate=False)
        if p.dim() >= 2 and (re.search(r"\.0\.", n) or ".pooler." in n) and n not in NO_DECAY[label]
    }
    hidden = hidden_matrix_names(model)
    assert hidden == in_blocks, (label, sorted(hidden ^ in_blocks))
    assert hidden, label
