"""Corrupt or mismatched data inputs are refused in one line naming the file (and line), when the
data is loaded, not by an error deep in training; a very long document is tokenized in bounded
pieces with the same ids. In one process, on a small corpus prepared once."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from framework.data.prepare import prepare

    root = tmp_path_factory.mktemp("faults")
    corpus = root / "c.jsonl"
    line = "lorem ipsum  dolor, sit amet! "
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + line * (5 + i)}) + "\n" for i in range(40)))
    prefix, tok = prepare([str(corpus)], str(root / "c"), vocab_size=300, progress=False)
    return root, prefix, tok


def _build(prefix, tokenizer, cache):
    from framework.data.indexed import build_indexed

    return build_indexed([prefix], [], split="90,10,0", seq_len=16, seed=1, tokenizer=tokenizer, cache_dir=str(cache))


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path):
    from framework.data.prepare import iter_documents
    from framework.errors import UserInputError

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9"}\n')
    docs = iter_documents([str(path)])
    assert next(docs) == "fine"
    with pytest.raises(UserInputError, match=rf"{path}:3 is not valid UTF-8 \(byte 13 of the line"):
        next(docs)


def test_truncated_bin_is_refused_when_loaded(prepared, tmp_path):
    from framework.data.tokenizer import BPETokenizer
    from framework.errors import UserInputError

    root, prefix, tok = prepared
    copy = str(tmp_path / "c")
    size = os.path.getsize(prefix + ".bin")
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as src, open(copy + ext, "wb") as dst:
            data = src.read()
            dst.write(data[: size - 10] if ext == ".bin" else data)  # an interrupted copy
    with pytest.raises(
        UserInputError,
        match=rf"{copy}.bin has {size - 10} bytes but {copy}.idx describes "
        rf"{size}: the .bin is truncated",
    ):
        _build(copy, BPETokenizer(tok), tmp_path / "cache")


def test_data_from_another_tokenizer_is_refused(prepared, tmp_path):
    from framework.data.indexed import MegatronTokenizerInfo
    from framework.errors import UserInputError

    _, prefix, _ = prepared
    train, _ = _build(prefix, MegatronTokenizerInfo(300, eod=299), tmp_path / "cache")  # the right size: fine
    assert len(train) > 0
    with pytest.raises(
        UserInputError,
        match=rf"{prefix}.bin holds token id \d+, but model.args.vocab_size=100 has only "
        "100 ids: the data was prepared with another tokenizer",
    ):
        _build(prefix, MegatronTokenizerInfo(100, eod=99), tmp_path / "cache")


def test_long_document_is_encoded_in_pieces_with_the_same_ids(prepared, monkeypatch):
    from framework.data import prepare as prep
    from framework.data.tokenizer import BPETokenizer

    monkeypatch.setattr(prep, "PIECE_CHARS", 10_000)  # the same code path on a smaller document
    tok = BPETokenizer(prepared[2])
    # Words, runs of spaces, punctuation and newlines across several piece boundaries.
    doc = "".join(f"lorem{i % 97}  ipsum, dolor\n sit   amet! " for i in range(1500))
    assert len(doc) > 3 * prep.PIECE_CHARS
    pieces = prep.pieces(doc)
    assert "".join(pieces) == doc and len(pieces) >= 4 and max(map(len, pieces)) <= prep.PIECE_CHARS
    (ids,) = prep.encode_documents(tok, [doc])
    assert ids.tolist() == tok.encode(doc) + [tok.eod]
    assert os.path.isfile(prepared[2])


def test_prepared_documents_are_the_tokenizers_own_ids_then_one_end_of_document(tmp_path, monkeypatch):
    # A Llama/Mistral/Gemma-style tokenizer puts its BOS before every text (`tokenizer(text)`): a
    # prepared document is <bos> text <eos>, as Megatron-LM's data preprocessing tool makes it with
    # --append-eod, a long one (encoded in pieces) too; the same tokenizer without its post-processor gives
    # the ids it always gave.
    import transformers
    from bos_tokenizer import bos_tokenizer
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from framework.data import prepare as prep
    from framework.data.stdlib import stdlib_prefix

    monkeypatch.setattr(prep, "PIECE_CHARS", 10_000)  # the piecewise path on a smaller document
    texts = ["what is 1 plus 2? it is 3", "x = 4; y = x + 1 " * 1500, " y"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for bos in (True, False):
        directory = bos_tokenizer(str(tmp_path / f"tok{bos}"), bos=bos)
        fast = transformers.AutoTokenizer.from_pretrained(directory)
        prefix, _ = prep.prepare(
            [str(corpus)], str(tmp_path / f"c{bos}"), tokenizer=f"{directory}/tokenizer.json", progress=False
        )
        dataset = IndexedDataset(prefix)
        for i, text in enumerate(texts):
            want = fast(text)["input_ids"] + [fast.eos_token_id]
            assert dataset[i].tolist() == want, (bos, i)
            assert (want[0] == fast.bos_token_id) == bos
        # data=stdlib's cache of a BOS-adding tokenizer is not one prepared before BOS was added
        assert stdlib_prefix(str(tmp_path), 0, f"{directory}/tokenizer.json").split(os.sep)[-2].endswith("-s") == bos
