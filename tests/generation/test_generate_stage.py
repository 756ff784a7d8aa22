"""`stage=generate` refuses what decoding cannot do, in one line and before loading any weights; its
terminal stream prints exactly the final text."""

from __future__ import annotations

from conftest import TINY, run_main


def test_sequence_parallel_is_refused_by_name(tmp_path):
    out = run_main(
        TINY
        + ["stage=generate", "cluster.nproc_per_node=2", "parallelism.tp=2", "parallelism.sequence_parallel=true"]
        + ['generate.prompts=["def add(a, b):"]', f"hydra.run.dir={tmp_path}/g"],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: stage=generate with parallelism.sequence_parallel=true: decoding feeds one token at a time, which "
        "cannot be split over the tp ranks; set parallelism.sequence_parallel=false (tp stays)"
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def _streamed(decodes: list, stops: list, final: str, capsys) -> str:
    """What stage=generate's stream prints for a completion whose i-th token decodes to decodes[i]."""
    from framework.generate import _Stream

    stream = _Stream(lambda ids: decodes[len(ids) - 1], None, stops, show=True)
    for i in range(len(decodes)):
        stream(0, list(range(i + 1)))
    stream.end(final)
    return capsys.readouterr().out


def test_the_stream_prints_the_final_text_through_unfinished_characters_and_stop_strings(capsys):
    # a byte-level tokenizer decodes half of a two-byte character as U+FFFD until its second byte
    # comes (the stream once stalled on it and printed nothing after)
    assert _streamed(["a", "ab\ufffd", "ab\u00e9", "ab\u00e9c"], [], "ab\u00e9c", capsys) == "ab\u00e9c"
    # a tail that may begin a stop string waits; the stop string itself is never printed
    decodes = ["x =", "x = 1", "x = 1\n", "x = 1\n\n", "x = 1\n\ny"]
    assert _streamed(decodes, ["\n\n"], "x = 1", capsys) == "x = 1"
    assert _streamed(["ab", "ab\n", "ab\nc"], ["\n\n"], "ab\nc", capsys) == "ab\nc"


def test_prompt_ids_are_the_tokenizers_own_with_its_bos(tmp_path, monkeypatch, capsys):
    # `tokenizer(prompt)` in transformers puts a Llama/Mistral/Gemma tokenizer's BOS first; the model
    # learnt with it, so stage=generate's prompt ids are those, whichever way the tokenizer is read
    # (a directory through transformers, a tokenizer.json: data=stdlib/hf, data=indexed).
    from types import SimpleNamespace

    import transformers
    from bos_tokenizer import bos_tokenizer

    import framework.generation
    from framework.config.schema import GenerateConfig
    from framework.data.tokenizer import BPETokenizer, load_tokenizer
    from framework.generate import generate
    from framework.models.llama.args import LlamaArgs
    from framework.models.llama.model import Transformer

    directory = bos_tokenizer(str(tmp_path / "tok"))
    fast = transformers.AutoTokenizer.from_pretrained(directory)
    model = Transformer(LlamaArgs(vocab_size=len(fast), dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48))
    model.init_weights(seed=0)
    seen = []
    real = framework.generation.generate
    monkeypatch.setattr(
        framework.generation, "generate", lambda m, ids, *a, **k: seen.append(ids) or real(m, ids, *a, **k)
    )
    prompts = ["what is 1 plus 2? it is ", "x = 4"]
    cfg = GenerateConfig(prompts=prompts, max_new_tokens=3, temperature=0.0, batch_size=2)
    for tok in (
        load_tokenizer(directory),
        load_tokenizer(f"{directory}/tokenizer.json"),
        BPETokenizer(f"{directory}/tokenizer.json"),
    ):
        seen.clear()
        trainer = SimpleNamespace(cfg=SimpleNamespace(generate=cfg), data=SimpleNamespace(tokenizer=tok), model=model)
        records = generate(trainer, prompts, is_main=True)
        assert seen == [[fast(p)["input_ids"] for p in prompts]], type(tok)
        assert seen[0][0][0] == fast.bos_token_id
        # what is shown is the prompt's text, not the BOS
        assert [r["prompt"] for r in records] == prompts
        assert "<s>" not in capsys.readouterr().out
