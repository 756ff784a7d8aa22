"""Tensor parallelism for Hugging Face models (transformers' own `base_model_tp_plan`), as a user
runs it: tp=2 and dp_shard=2 x tp=2 train like one process, the export loads in transformers, and
families whose plan we do not apply are refused by name.

Tolerance 1e-5 (fp32) as in [Note: tolerance of the tensor-parallel comparisons] (test_tp_training.py):
the split matmuls sum their partial products in another order than one process does."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import TINY, read_metrics, run_main

CONFIGS = {
    "llama": "{model_type: llama, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}",
    "qwen2": "{model_type: qwen2, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}",
    "mistral": "{model_type: mistral, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, sliding_window: null}",
    # q_norm / k_norm over each head's features: replicated_with_grad_allreduce
    "qwen3": "{model_type: qwen3, num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, "
    "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, head_dim: 16}",
}
STEPS = ["trainer.max_steps=5", "trainer.eval_interval=0", "checkpoint.export_safetensors=true"]


def _run(tmp_path, family: str, ranks: int, tp: int, name: str):
    run = tmp_path / name
    out = run_main(
        [*TINY, *STEPS, "model=hf", f"model.config={CONFIGS[family]}", f"cluster.nproc_per_node={ranks}"]
        + [f"parallelism.tp={tp}", f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return run, [r["loss"] for r in read_metrics(run)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_tp2_trains_like_one_process_and_its_export_loads_in_transformers(tmp_path, family):
    import transformers

    one, want = _run(tmp_path, family, 1, 1, "one")
    tp2, got = _run(tmp_path, family, 2, 2, "tp2")
    assert got == pytest.approx(want, abs=1e-5)
    layouts = [tp2]
    if family == "llama":  # the 2-D mesh: dp_shard=2 x tp=2 on 4 ranks
        dp2tp2, got4 = _run(tmp_path, family, 4, 2, "dp2tp2")
        assert got4 == pytest.approx(want, abs=1e-5)
        layouts.append(dp2tp2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(one / "checkpoints" / "export")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        for run in layouts:
            model = transformers.AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "export")
            assert type(model) is type(reference)
            torch.testing.assert_close(model(tokens).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "config, needle",
    [
        (
            "{model_type: olmo2, num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, "
            "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}",
            "its plan uses colwise_gather_output",
        ),
        ("{model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2, vocab_size: 128}", "ships no tensor-parallel plan"),
        (
            "{model_type: llama, num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, "
            "num_attention_heads: 4, num_key_value_heads: 1, vocab_size: 256}",
            "does not divide num_key_value_heads=1",
        ),
    ],
    ids=["olmo2", "gpt2", "kv_heads"],
)
def test_families_the_plan_cannot_split_are_refused_by_name(tmp_path, config, needle):
    out = run_main(
        [*TINY, "trainer.max_steps=1", "model=hf", f"model.config={config}", "parallelism.tp=2"]
        + [f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_the_planner_splits_a_hf_model_by_its_plan():
    """stage=plan at tp=2: each rank holds half of every split matrix; the total is the model's."""
    from framework.config.schema import ClusterConfig, Config, DataConfig, ModelConfig, ParallelismConfig
    from framework.models.shapes import param_count, units
    from framework.planner.plan import job_from_config

    def job(tp):
        cfg = Config(
            model=ModelConfig(name="hf", config=yaml.safe_load(CONFIGS["llama"])),
            data=DataConfig(name="synthetic", seq_len=32),
            parallelism=ParallelismConfig(tp=tp),
            cluster=ClusterConfig(nproc_per_node=2),
        )
        return job_from_config(cfg)

    full, split = job(1), job(2)
    assert param_count(split.model) == param_count(full.model)
    per_rank = [u.numel for u in units(split.model, 2)]
    whole = [u.numel for u in units(full.model, 1)]
    # a block: q (64x64), k, v (32x64 each), o (64x64), gate, up (128x64), down (64x128) halve; 2 norms of 64 do not
    assert per_rank[1] == (whole[1] - 2 * 64) // 2 + 2 * 64
    # the root: embedding and head (256x64 each) halve, the final norm does not
    assert per_rank[0] == 2 * 256 * 64 // 2 + 64
