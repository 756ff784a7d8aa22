"""Our Llama's Hugging Face export and `checkpoint.init_from` import, on one process.

The export (config, weights, generation config, tokenizer) is read by transformers itself; the
import adopts nothing silently: every config.json field that changes the computation either
matches the configured model or is refused in one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

from framework.checkpoint.hf import export_safetensors, import_safetensors, weight_files
from framework.config.schema import ModelConfig
from framework.errors import UserInputError
from framework.models import family_of

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _llama(**overrides) -> ModelConfig:
    # debug-sized: head_dim 16 gives rotary frequencies on both sides of the llama3 bands.
    return ModelConfig(
        name="debug",
        args={
            "vocab_size": 96,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "ffn_dim": 96,
            "max_seq_len": 128,
            **overrides,
        },
    )


def _export(cfg: ModelConfig, out, tokenizer=None, max_shard_bytes=5 * 2**30):
    family = family_of(cfg)
    model = family.build(cfg, "cpu")
    family.init_weights(model, 0)
    adapter = family.adapter(cfg)
    export_safetensors(
        model.state_dict(),
        adapter,
        adapter.hf_config(cfg, torch.float32),
        str(out),
        rank=0,
        max_shard_bytes=max_shard_bytes,
    )
    adapter.write_extras(str(out), tokenizer, cfg)
    return model, adapter


def _tokenizer(tmp_path):
    from framework.data.tokenizer import EOD, train_bpe

    texts = [f"def f{i}(x):\n    return x + {i}\n{EOD}" for i in range(50)]
    return train_bpe(texts, 300, str(tmp_path / "tokenizer.json"))


def test_export_with_llama3_rope_scaling_and_tokenizer_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cfg = _llama(rope_scaling=dict(LLAMA3_SCALING), rope_theta=500000.0, norm_eps=1e-6)
    tok = _tokenizer(tmp_path)
    assert tok.eod == 0  # our end-of-document token is id 0
    model, _ = _export(cfg, tmp_path / "export", tok)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(cfg.args["vocab_size"], (2, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits - model(ids)).abs().max().item()
    # fp32, same weights, same math in another order: ~1e-6. Without the llama3 scaling the
    # rotary angles differ and the logits by ~2e-3.
    assert diff <= 1e-5, diff
    generation = GenerationConfig.from_pretrained(tmp_path / "export")
    assert (generation.eos_token_id, generation.bos_token_id, generation.pad_token_id) == (0, 0, 0)
    assert hf.config.eos_token_id == 0 and hf.config.pad_token_id == 0
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "def f3(x):\n    return x + 3\n"
    assert hf_tok(text)["input_ids"] == tok.encode(text) and hf_tok.eos_token_id == 0


def test_sharded_export_with_index_reads_back_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _llama()
    model, adapter = _export(cfg, tmp_path / "export", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really several files
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not any(info.values()), info
    fresh = family_of(cfg).build(cfg, "cpu")
    loaded, count = import_safetensors(str(tmp_path / "export"), fresh.state_dict(), adapter, "checkpoint.init_from")
    assert count == len(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "field, value, fix",
    [
        ("rope_theta", 500000.0, "model.args.rope_theta=500000"),
        ("rope_scaling", LLAMA3_SCALING, "model.args.rope_scaling="),
        ("rms_norm_eps", 1e-6, "model.args.norm_eps=1e-06"),
        ("hidden_act", "gelu", "silu"),
        ("attention_bias", True, "no bias"),
        ("mlp_bias", True, "no bias"),
        ("tie_word_embeddings", True, "model.args.tie_embeddings=true"),
        ("model_type", "mistral", "model=hf"),
        ("num_key_value_heads", 4, "model.args.n_kv_heads=4"),
    ],
)
def test_a_config_that_computes_differently_is_refused_naming_the_field(field, value, fix, tmp_path):
    cfg = _llama()
    _, adapter = _export(cfg, tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    adapter.check_hf_config(hf, cfg, "checkpoint.init_from=x")  # the export itself is accepted
    hf[field] = value
    with pytest.raises(UserInputError) as info:
        adapter.check_hf_config(hf, cfg, "checkpoint.init_from=x")
    message = str(info.value)
    assert field in message and fix in message and "\n" not in message, message


def test_transformers_5_rope_parameters_are_read_too(tmp_path):
    cfg = _llama(rope_scaling=dict(LLAMA3_SCALING), rope_theta=500000.0)
    _, adapter = _export(cfg, tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    hf["rope_parameters"] = dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta"))
    adapter.check_hf_config(hf, cfg, "checkpoint.init_from=x")
    hf["rope_parameters"]["factor"] = 32.0
    with pytest.raises(UserInputError, match="rope_scaling"):
        adapter.check_hf_config(hf, cfg, "checkpoint.init_from=x")


def test_tensors_the_model_does_not_use_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = _llama()
    model, adapter = _export(cfg, tmp_path / "export")
    tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "export" / "model.safetensors"))
    with pytest.raises(UserInputError, match=r"1 tensor\(s\) this model does not use \(model.layers.0.self_attn"):
        import_safetensors(str(tmp_path / "export"), model.state_dict(), adapter, "checkpoint.init_from=x")


def test_a_file_or_a_parent_directory_gets_one_line_naming_the_right_directory(tmp_path):
    _export(_llama(), tmp_path / "runs" / "export")
    with pytest.raises(UserInputError, match="this is a file; give the directory"):
        weight_files(str(tmp_path / "runs" / "export" / "model.safetensors"), "checkpoint.init_from=x")
    with pytest.raises(UserInputError, match=f"{tmp_path / 'runs' / 'export'} holds one; give that directory"):
        weight_files(str(tmp_path / "runs"), "checkpoint.init_from=x")
