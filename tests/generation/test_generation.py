"""framework/generation on one process: the KV cache (ours and transformers' DynamicCache) gives the
tokens of full recomputation, a left-padded batch gives each prompt's tokens alone, rows stop at an
end-of-text id and at stop strings, seeded sampling repeats and does not depend on the batch, and
transformers' own generate(do_sample=False) on our exported Llama picks our tokens.

The models are random (tiny, fp32): their greedy tokens are far from ties, so "the same tokens"
is exact equality, not a tolerance."""

from __future__ import annotations

import pytest
import torch

from framework.generation import generate

PROMPTS = [[5, 17, 3, 9, 11, 2, 40], [7], [60, 1, 22, 8]]  # uneven: the batch pads two of them


def _llama(vocab: int = 64, seed: int = 3):
    from framework.models.llama.args import LlamaArgs
    from framework.models.llama.model import Transformer

    model = Transformer(
        LlamaArgs(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
    )
    model.init_weights(seed=seed)
    # init_std 0.02 makes nearly uniform logits; scale the head so greedy picks are not near-ties
    model.output.weight.data.mul_(30)
    return model


def _hf_llama(vocab: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    model.lm_head.weight.data.normal_(0, 1.0)
    return model


MODELS = {"ours": _llama, "transformers": _hf_llama}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_greedy_with_the_cache_equals_recomputing_and_a_batch_equals_one_at_a_time(family):
    model = MODELS[family]()
    cached = generate(model, PROMPTS, 20)
    recomputed = generate(model, PROMPTS, 20, use_cache=False)
    alone = [generate(model, [p], 20)[0] for p in PROMPTS]
    ids = [c.token_ids for c in cached]
    assert all(len(i) == 20 for i in ids) and len({tuple(i) for i in ids}) == 3, ids
    assert ids == [c.token_ids for c in recomputed]
    assert ids == [c.token_ids for c in alone]
    assert all(c.finish_reason == "length" for c in cached)
    assert model.training  # left as it was found


@pytest.mark.parametrize("family", sorted(MODELS))
def test_rows_stop_at_the_end_of_text_and_at_stop_strings(family):
    model = MODELS[family]()
    free = generate(model, PROMPTS, 12)
    # the second prompt's 4th greedy token as end-of-text: that row ends at its first, with it
    eos = free[1].token_ids[3]
    stopped = generate(model, PROMPTS, 12, eos_ids=[eos])
    for before, after in zip(free, stopped):
        cut = before.token_ids.index(eos) + 1 if eos in before.token_ids else len(before.token_ids)
        assert after.token_ids == before.token_ids[:cut]
        assert after.finish_reason == ("eos" if cut < len(before.token_ids) or eos in before.token_ids else "length")
    assert stopped[1].token_ids[-1] == eos and len(stopped[1].token_ids) <= 4

    def decode(ids):
        return " ".join(f"t{i}" for i in ids)

    # a stop string that the first row's text reaches at its 5th token
    stop = f"t{free[0].token_ids[4]} "
    text = generate(model, PROMPTS, 12, stop_strings=[stop], decode=decode)
    first = decode(free[0].token_ids)
    assert text[0].finish_reason == "stop" and text[0].text == first[: first.index(stop)]
    assert text[0].token_ids == free[0].token_ids[: len(text[0].token_ids)] and len(text[0].token_ids) <= 6
    assert text[2].text == decode(text[2].token_ids)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_seeded_sampling_repeats_and_a_prompt_draws_the_same_in_any_batch(family):
    model = MODELS[family]()
    settings = dict(temperature=1.0, top_k=20, top_p=0.95)
    a = generate(model, PROMPTS, 16, seed=11, **settings)
    b = generate(model, PROMPTS, 16, seed=11, **settings)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # seed + i per prompt: prompt 2 alone with seed 13 draws what it drew third in a batch of seed 11
    alone = generate(model, [PROMPTS[2]], 16, seed=[13], **settings)[0]
    assert alone.token_ids == a[2].token_ids
    other = generate(model, PROMPTS, 16, seed=12, **settings)
    greedy = generate(model, PROMPTS, 16)
    assert [c.token_ids for c in other] != [c.token_ids for c in a]
    assert [c.token_ids for c in a] != [c.token_ids for c in greedy]
    assert [c.token_ids for c in generate(model, PROMPTS, 16, seed=11, batch_size=1, **settings)] == [
        c.token_ids for c in a
    ]


def test_transformers_generate_on_our_export_picks_our_tokens(tmp_path):
    """Our Llama exported to safetensors (framework/checkpoint/hf.py), read by transformers: its
    own generate(do_sample=False) gives the tokens our cached greedy decoding gives."""
    from transformers import AutoModelForCausalLM

    from framework.checkpoint.hf import export_safetensors
    from framework.config.schema import ModelConfig
    from framework.models import family_of

    cfg = ModelConfig(
        name="debug",
        args={
            "vocab_size": 96,
            "dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "ffn_dim": 96,
            "max_seq_len": 128,
        },
    )
    family = family_of(cfg)
    ours = family.build(cfg, "cpu")
    family.init_weights(ours, 0)
    ours.output.weight.data.mul_(30)
    adapter = family.adapter(cfg)
    export_safetensors(ours.state_dict(), adapter, adapter.hf_config(cfg, torch.float32), str(tmp_path), rank=0)
    adapter.write_extras(str(tmp_path), None, cfg)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    prompt = [3, 50, 7, 21, 90]
    want = generate(ours, [prompt], 24)[0].token_ids
    got = theirs.generate(
        torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert got == want
    # left-padded batches agree too: transformers' mask and positions, ours
    batch = [[9, 4, 33], prompt]
    ids = torch.tensor([[0, 0] + batch[0], prompt])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    got = theirs.generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[:, 5:].tolist()
    assert got == [c.token_ids for c in generate(ours, batch, 12)]
