"""Hugging Face models through our engine equal transformers on one process.

One 2-rank spawn runs every case (and checks that weights start from a save_pretrained directory
exactly, each rank reading only its slices): for GPT-2, Llama, Qwen2 (causal LM), T5 (seq2seq, relative
attention bias, tied embeddings) and GPT-2 sequence classification, the initial logits and the
first 5 training losses of the trainer (2 ranks, sharded per `_no_split_modules` block, 2
gradient-accumulation micro-steps) are compared with a plain transformers model trained on one
process from the same initial weights on the same global batches. Tolerance 1e-5 (fp32): the
sharded run reduces gradients in another order (reduce-scatter over 2 ranks, 2 micro-steps), which
moves fp32 results by ~1e-7 per step; 1e-5 leaves room for 5 steps of that and nothing more (a
wrong shard, a lost gradient or an untied weight moves the loss by > 1e-3).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 128,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 1,
}
LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
QWEN2 = dict(LLAMA, model_type="qwen2")
T5 = {
    "model_type": "t5",
    "num_layers": 2,
    "num_decoder_layers": 2,
    "d_model": 32,
    "d_kv": 8,
    "num_heads": 4,
    "d_ff": 64,
    "vocab_size": 128,
    "dropout_rate": 0.0,
    "relative_attention_num_buckets": 8,
}

CASES = [  # (label, inline config, task, parallelism settings)
    ("gpt2", GPT2, "causal_lm", {}),
    ("llama", LLAMA, "causal_lm", {}),
    ("qwen2", QWEN2, "causal_lm", {}),
    ("t5", T5, "seq2seq", {}),
    ("gpt2_classify", GPT2, "sequence_classification", {}),
    ("t5_torch_engine", T5, "seq2seq", {"engine": "torch"}),
    ("t5_activation_checkpointing", T5, "seq2seq", {"activation_checkpointing": "full"}),
]
TOL = 1e-5  # see the module docstring


def make_config(model_config: dict, task: str, parallelism: dict, run_dir: str, steps: int = 5, **model):
    from framework.config.schema import (
        CheckpointConfig,
        Config,
        DataConfig,
        ModelConfig,
        OptimizerConfig,
        ParallelismConfig,
        TrainerConfig,
    )

    return Config(
        model=ModelConfig(
            name="hf", config=dict(model_config) if model_config else None, task=task, args={"max_seq_len": 64}, **model
        ),
        parallelism=ParallelismConfig(**parallelism),
        data=DataConfig(name="synthetic", seq_len=16),
        # SGD with momentum: a gradient scaled wrongly shows at once (Adam would normalise it away).
        optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.9, warmup_steps=0, schedule="constant"),
        trainer=TrainerConfig(
            max_steps=steps, global_batch_size=4, micro_batch_size=1, eval_interval=0, progress_bar=False
        ),
        checkpoint=CheckpointConfig(save_final=False),
        run_dir=run_dir,
    )


def _reference(cfg, steps: int):
    """The trainer's model build and data, trained by plain transformers on this one process."""
    from framework.models import family_of
    from tests.hf.one_process import train_steps, whole_batch_data

    family = family_of(cfg.model)
    task = family.task(cfg.model)
    torch.manual_seed(cfg.trainer.seed)  # the trainer's sequence: seed, a meta build, the real build
    family.build(cfg.model, "meta")
    model = family.build(cfg.model, "cpu")
    family.init_weights(model, cfg.trainer.seed)
    initial = copy.deepcopy(model)
    losses, _ = train_steps(model, task, whole_batch_data(cfg, family, task), cfg, steps)
    return initial, losses


def _probe(cfg):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(128, (2, 12), generator=gen)
    if cfg.model.task == "seq2seq":
        return {"input_ids": ids, "decoder_input_ids": ids[:, :6]}
    return {"input_ids": ids}


def _parity_rank(rank, world, run_dir, source):
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label, model_config, task, parallelism in CASES:
        cfg = make_config(model_config, task, parallelism, run_dir)
        initial, ref_losses = _reference(cfg, 5)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        with torch.no_grad():
            ours = trainer.model(**_probe(cfg)).logits
            ref = initial(**_probe(cfg)).logits
        losses = [trainer.train_step()["loss"] for _ in range(5)]
        out[label] = {
            "logits": (ours - ref).abs().max().item(),
            "losses": losses,
            "ref_losses": ref_losses,
            "blocks": len(trainer.family.blocks(trainer.model)),
        }
        del trainer
    out["sliced_load"] = {
        engine: _load_from_path(rank, world, run_dir, source, engine) for engine in ("native", "torch")
    }
    return out


def _load_from_path(rank, world, run_dir, source, engine) -> float:
    """Start from a save_pretrained directory (each rank reading its slices); return the largest
    difference between the sharded model's gathered weights and the file's tensors."""
    from safetensors import safe_open

    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    cfg = make_config({}, "causal_lm", {"engine": engine}, run_dir, path=source)
    trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
    assert trainer.ckpt.resume(trainer.state) == 0
    worst, tied = 0.0, trainer.ckpt._adapter(trainer.model.state_dict(), "model.path")[1].tied
    with safe_open(f"{source}/model.safetensors", framework="pt") as f:
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            worst = max(worst, (whole - f.get_tensor(tied.get(name, name))).abs().max().item())
    trainer.ckpt.close()
    return worst


def test_hf_models_on_two_ranks_equal_transformers_on_one_process(tmp_path):
    import transformers

    from tests.distributed.harness import run_ranks

    # An odd vocabulary and width: the shards of each matrix are uneven (torch.chunk sizes).
    source = tmp_path / "gpt2"
    config = dict(GPT2, vocab_size=127, n_embd=36, n_head=3)
    config.pop("model_type")
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).save_pretrained(source)
    results = run_ranks(_parity_rank, world_size=2, args=(str(tmp_path), str(source)), timeout_s=300)
    for label, *_ in CASES:
        for rank in range(2):
            r = results[rank][label]
            assert r["logits"] <= TOL, (label, rank, r)
            assert r["blocks"] == (4 if label.startswith("t5") else 2), (label, r)  # encoder + decoder blocks
            diffs = [abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])]
            assert len(diffs) == 5 and all(math.isfinite(x) for x in r["losses"]), (label, r)
            assert max(diffs) <= TOL, (label, rank, r)
        # The losses must change (a model that never trains would pass the comparison trivially).
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, results[0][label])
    # Weights read slice by slice from model.path are the file's, exactly, with either engine.
    assert all(r["sliced_load"] == {"native": 0.0, "torch": 0.0} for r in results), [r["sliced_load"] for r in results]


def test_a_hub_name_is_refused_in_one_line(tmp_path):
    from framework.config.schema import ModelConfig
    from framework.errors import UserInputError
    from framework.models import family_of

    cfg = ModelConfig(name="hf", path="openai-community/gpt2")
    with pytest.raises(UserInputError) as info:
        family_of(cfg).build(cfg, "meta")
    assert "download it first" in str(info.value) and "\n" not in str(info.value)
