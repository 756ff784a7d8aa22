"""Pre-training a Hugging Face model (`model=hf model.path=<dir>`) on data another tokenizer made:
refused before any rank starts, in one line naming both tokenizer files, whether the other one is
bigger (its ids past the embedding were an IndexError at the first batch) or the same size (the
model trained on the wrong token table without a word). Data prepared with the model's own
tokenizer trains, and so does the embedded corpus, which is then prepared with it."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_main

MODEL_VOCAB = 400  # the GPT-2's embedding rows; its own tokenizer has fewer ids (_model_dir)


def _texts(n_files: int = 6) -> list:
    """Real text to train tokenizers on: a few of this Python's standard-library sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f"{name}.py" for name in ("argparse", "inspect", "textwrap", "string", "shlex", "fnmatch")]
    return [f.read_text(encoding="utf-8") for f in files[:n_files]]


def _bpe(vocab_size: int, texts: list, eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[eos], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _model_dir(out: Path, with_tokenizer: bool = True) -> int:
    """A save_pretrained GPT-2 of MODEL_VOCAB ids, with its own byte-level BPE of 330 ids (trained on
    other text than the data's, with its own end-of-text token); returns the tokenizer's size."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=MODEL_VOCAB, n_positions=64, eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    if not with_tokenizer:
        return 0
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_bpe(330, _texts()[3:], "<|eos|>"), eos_token="<|eos|>"
    )
    fast.save_pretrained(out)
    return len(fast)


def _corpus(root: Path) -> Path:
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for text in _texts():
            for i in range(0, len(text), 3000):
                f.write(json.dumps({"text": text[i : i + 3000]}) + "\n")
    return corpus


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tokenizer")
    size = _model_dir(root / "model")
    return {"root": root, "model": root / "model", "size": size, "corpus": _corpus(root)}


def _prepare(setup, name: str, *settings: str) -> Path:
    prefix = setup["root"] / name / "data"
    out = run_main(
        ["stage=data_preparation", f"data.raw_inputs=[{setup['corpus']}]", f"data.output_prefix={prefix}"]
        + ["data.workers=1", *settings, f"hydra.run.dir={setup['root']}/{name}/prep"],
        setup["root"],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return prefix


def _train(model: Path, tmp_path: Path, *settings: str):
    args = [a for a in TINY if not a.startswith(("model=", "data="))]
    return run_main(
        args
        + ["model=hf", f"model.path={model}", "data.seq_len=32", "trainer.max_steps=2", "trainer.eval_interval=0"]
        + ["trainer.global_batch_size=2", "trainer.micro_batch_size=1", "cluster.nproc_per_node=1", *settings]
        + [f"data.cache_dir={tmp_path}/cache", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )


def _refused_in_one_line(out) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize("bigger", [True, False], ids=["bigger-bpe", "same-size-bpe"])
def test_indexed_data_from_another_tokenizer_is_refused_naming_both(setup, tmp_path, bigger):
    vocab = 600 if bigger else setup["size"]  # 600 > the model's 400 rows; or exactly the model's tokenizer's size
    prefix = _prepare(setup, f"bpe{vocab}", f"data.vocab_size={vocab}")
    if not bigger:
        assert len(json.loads(Path(f"{prefix}.tokenizer.json").read_text())["model"]["vocab"]) == setup["size"]
    out = _train(setup["model"], tmp_path, "data=indexed", f"data.paths=[{prefix}]", "data.split='90,10,0'")
    error = _refused_in_one_line(out)
    assert f"data.paths: {prefix} was prepared with the tokenizer {prefix}.tokenizer.json" in error, error
    assert f"model.path's {setup['model']}/tokenizer.json" in error, error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_indexed_data_prepared_with_the_models_tokenizer_trains(setup, tmp_path):
    """Data preparation records the tokenizer it was given next to the data (<prefix>.tokenizer.json),
    so training reads it without data.tokenizer, and the check finds the model's table."""
    model_tok = setup["model"] / "tokenizer.json"
    prefix = _prepare(setup, "own", f"data.tokenizer={model_tok}")
    assert Path(f"{prefix}.tokenizer.json").read_bytes() == model_tok.read_bytes()
    out = _train(setup["model"], tmp_path, "data=indexed", f"data.paths=[{prefix}]", "data.split='90,10,0'")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [row["step"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())] == [1, 2]


def test_the_embedded_corpus_is_prepared_with_the_models_tokenizer(setup, tmp_path):
    out = _train(setup["model"], tmp_path, "data=stdlib")
    assert out.returncode == 0, out.stderr[-3000:]
    (recorded,) = (tmp_path / "cache").glob("stdlib-*/stdlib.tokenizer.json")
    assert recorded.read_bytes() == (setup["model"] / "tokenizer.json").read_bytes()
    assert [row["step"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())] == [1, 2]


def test_a_data_tokenizer_other_than_the_models_is_refused_for_the_embedded_corpus(setup, tmp_path):
    other = setup["root"] / "other.tokenizer.json"
    _bpe(setup["size"], _texts()[:3], "<|endoftext|>").save(str(other))
    out = _train(setup["model"], tmp_path, "data=stdlib", f"data.tokenizer={other}")
    error = _refused_in_one_line(out)
    assert f"data.tokenizer={other}: its token table is not model.path's {setup['model']}/tokenizer.json" in error
    assert not (tmp_path / "cache").exists()  # nothing was prepared


def test_a_model_without_a_tokenizer_refuses_ids_past_its_embedding(tmp_path, stdlib_cache):
    """No token table to compare: the ids of the data (the embedded corpus's 2048-id BPE) are held
    to the model's 400 rows when the data is loaded, in one line, on every rank."""
    _model_dir(tmp_path / "bare", with_tokenizer=False)
    args = [a for a in TINY if not a.startswith(("model=", "data="))]
    out = run_main(
        args
        + ["model=hf", f"model.path={tmp_path / 'bare'}", "data=stdlib", "data.seq_len=32", "trainer.max_steps=1"]
        + ["trainer.global_batch_size=2", "trainer.micro_batch_size=1", stdlib_cache, f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    error = _refused_in_one_line(out)
    assert f"but model.path={tmp_path / 'bare'} has only {MODEL_VOCAB} ids" in error, error
