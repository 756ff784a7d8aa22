"""Data preparation (`stage=data_preparation`) and the indexed / stdlib training sources.

A small corpus (text files in a directory plus a JSONL file) is prepared once through `main.py`
with a locally trained byte-level BPE and 2 worker processes; the tests read it back through
megatron-core's IndexedDataset and GPTDataset, as training does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import TINY, read_metrics, run_main

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def _text(seed: int, n_words: int) -> str:
    words = [WORDS[(seed * 7 + i * i + i * seed) % len(WORDS)] for i in range(n_words)]
    return " ".join(words) + f"\nline {seed}: ünïcödé ✓\n"


def _documents():
    files = {f"doc_{i:03d}.txt": _text(i, 40 + i % 50) for i in range(30)}
    records = [_text(100 + i, 20 + i % 30) for i in range(40)]
    return files, records


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    files, records = _documents()
    (root / "raw").mkdir()
    for name, text in files.items():
        (root / "raw" / name).write_text(text, encoding="utf-8")
    with open(root / "more.jsonl", "w", encoding="utf-8") as f:
        for text in records:
            f.write(json.dumps({"text": text, "id": len(text)}) + "\n")
    prefix = root / "out" / "corpus"
    out = run_main(
        [
            "stage=data_preparation",
            f"data.raw_inputs=[{root / 'raw'},{root / 'more.jsonl'}]",
            f"data.output_prefix={prefix}",
            "data.vocab_size=300",
            "data.workers=2",
            f"hydra.run.dir={root}/prep",
        ],
        root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    expected = [files[name] for name in sorted(files)] + records
    return {"root": root, "prefix": str(prefix), "texts": expected}


def _tokenizer(corpus):
    from framework.data.tokenizer import BPETokenizer

    return BPETokenizer(corpus["prefix"] + ".tokenizer.json")


def test_prepared_dataset_reads_back_the_same_token_stream(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = _tokenizer(corpus)
    assert tok.vocab_size == 300
    dataset = IndexedDataset(corpus["prefix"])
    assert len(dataset) == len(corpus["texts"]) == 70
    for i, text in enumerate(corpus["texts"]):
        ids = dataset[i].tolist()
        assert ids == tok.encode(text) + [tok.eod], f"document {i}"
        assert tok.decode(ids[:-1]) == text  # byte-level BPE: lossless, unicode included


def _windows_of_documents(sample, documents, eod):
    """Every eod-free run of tokens in `sample` is a contiguous piece of some document."""
    pieces, piece = [], []
    for t in sample:
        if t == eod:
            pieces.append(piece)
            piece = []
        else:
            piece.append(t)
    pieces.append(piece)
    for piece in pieces:
        if piece and not any(_contains(doc, piece) for doc in documents):
            return False
    return True


def _contains(doc, piece):
    n = len(piece)
    return any(doc[i : i + n] == piece for i in range(len(doc) - n + 1))


def test_training_samples_are_windows_of_the_documents(corpus):
    from framework.config.schema import DataConfig
    from framework.data import build_data

    cfg = DataConfig(
        name="indexed", seq_len=32, paths=[corpus["prefix"]], split="80,20,0", cache_dir=str(corpus["root"] / "cache")
    )
    bundle = build_data(cfg, vocab_size=-1, micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_size=1, seed=3)
    tok = bundle.tokenizer
    assert bundle.vocab_size == 300 and tok is not None
    docs = [tok.encode(text) for text in corpus["texts"]]
    for index in range(0, len(bundle.train.source), 7):
        sample = bundle.train.source[index].tolist()
        assert len(sample) == 33
        assert _windows_of_documents(sample, docs, tok.eod), f"train sample {index}"
    assert len(bundle.valid.source) > 0
    assert list(os.listdir(corpus["root"] / "cache" / "index")), "megatron's shuffled indices were not cached"


@pytest.fixture
def one_rank_group():
    """megatron-core builds blends only inside a process group (as training always runs)."""
    import torch.distributed as dist

    from framework.runtime import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_blend_weights_are_respected(corpus, tmp_path, one_rank_group):
    from framework.data.indexed import build_indexed
    from framework.data.prepare import prepare

    other = tmp_path / "other.jsonl"
    with open(other, "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": _text(500 + i, 30)}) + "\n")
    second, _ = prepare(
        [str(other)], str(tmp_path / "other"), tokenizer=corpus["prefix"] + ".tokenizer.json", workers=1, progress=False
    )
    train, _ = build_indexed(
        [corpus["prefix"], second],
        [3.0, 1.0],
        split="90,10,0",
        seq_len=16,
        seed=5,
        tokenizer=_tokenizer(corpus),
        cache_dir=str(tmp_path / "cache"),
    )
    ids = [int(train.dataset[i]["dataset_id"]) for i in range(len(train))]
    share = ids.count(0) / len(ids)
    # The blend picks each sample's dataset to keep the running share at the weight: exact up to
    # one sample of rounding, over a few hundred samples.
    assert len(ids) > 200 and abs(share - 0.75) < 0.01, (share, len(ids))


def test_stdlib_corpus_is_prepared_once_and_cached(tmp_path):
    from framework.config.schema import DataConfig
    from framework.data import build_data

    cfg = DataConfig(name="stdlib", seq_len=64, cache_dir=str(tmp_path))
    kw = dict(vocab_size=-1, micro_batch_size=2, global_batch_size=4, dp_rank=0, dp_size=1, seed=1)
    first = build_data(cfg, **kw)
    assert first.vocab_size == 2048
    prepared = [p for p in tmp_path.iterdir() if p.name.startswith("stdlib-")]
    assert len(prepared) == 1 and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    stamp = (prepared[0] / "stdlib.bin").stat().st_mtime_ns
    code = "def add(a, b):\n    return a + b\n"
    assert first.tokenizer.decode(first.tokenizer.encode(code)) == code
    second = build_data(cfg, **kw)
    assert (prepared[0] / "stdlib.bin").stat().st_mtime_ns == stamp, "the corpus was prepared twice"
    assert second.train.source[0].tolist() == first.train.source[0].tolist()
    assert len(first.train.source) > 1000 and len(first.valid.source) > 0


def test_training_on_prepared_data_through_main(corpus, tmp_path):
    out = run_main(
        TINY[:1]
        + TINY[2:]
        + [
            "data=indexed",
            f"data.paths=[{corpus['prefix']}]",
            "data.seq_len=32",
            "data.split='80,20,0'",
            f"data.cache_dir={tmp_path}/cache",
            "cluster.nproc_per_node=1",
            "trainer.max_steps=3",
            "trainer.eval_interval=3",
            "checkpoint.save_final=false",
            "trainer.sample_tokens=5",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3] and "val_loss" in rows[-1]


@pytest.mark.parametrize("case", ["missing", "no_text", "empty_prefix"])
def test_bad_input_is_one_line_naming_the_field(tmp_path, capsys, case):
    from framework.config.schema import Config, DataConfig
    from framework.data.prepare import prepare_data

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    data = {
        "missing": DataConfig(raw_inputs=[str(tmp_path / "nope")], output_prefix=str(tmp_path / "o")),
        "no_text": DataConfig(raw_inputs=[str(bad)], output_prefix=str(tmp_path / "o"), vocab_size=300),
        "empty_prefix": DataConfig(raw_inputs=[str(bad)]),
    }[case]
    assert prepare_data(Config(data=data)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.")
    assert {
        "missing": "does not exist",
        "no_text": "bad.jsonl:2 has no string 'text'",
        "empty_prefix": "data.output_prefix is empty",
    }[case] in err[0]
    assert not list(Path(tmp_path).glob("o.bin")) and not list(Path(tmp_path).glob("o.idx"))


def test_split_without_documents_is_refused(corpus, tmp_path):
    from framework.data.indexed import build_indexed

    with pytest.raises(ValueError, match=r"data.split='99.9,0.05,0.05' gives the valid split none"):
        build_indexed(
            [corpus["prefix"]],
            [],
            split="99.9,0.05,0.05",
            seq_len=16,
            seed=1,
            tokenizer=_tokenizer(corpus),
            cache_dir=str(tmp_path),
        )
