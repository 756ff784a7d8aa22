"""`stage=data_preparation`: raw text / JSONL -> Megatron indexed datasets (<prefix>.bin/.idx).

    python main.py stage=data_preparation data.raw_inputs=[corpus/,more.jsonl] data.output_prefix=data/corpus

Every input file is one document, except JSONL (`.jsonl`/`.json`), where every line is a document
whose text is its `text` field; directories are walked in sorted order. Documents are tokenized by
`data.workers` processes with a byte-level BPE (`data.tokenizer`, or one of `data.vocab_size`
trained on the inputs), recorded as `<prefix>.tokenizer.json`, each as `tokenizer(document)` encodes
it (the tokenizer's BOS first, where it adds one) and followed by the end-of-document token ([Note:
a document's special tokens]), and written with megatron-core's IndexedDatasetBuilder, so the
result is the same format NeMo and Megatron-LM read and write.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import framework.data.megatron_quiet  # noqa: F401  (before any megatron.core import)
from framework.errors import EXIT_BAD_INPUT, UserInputError
from framework.fileio import create_temporary

JSONL_SUFFIXES = (".jsonl", ".json")
_BATCH = 64  # documents per task handed to a worker


def input_files(raw_inputs: Sequence[str]) -> List[str]:
    """The regular files `raw_inputs` names, directories walked in sorted order. An entry that is
    not a regular file or directory is refused; inside a directory, FIFOs, devices, sockets (and
    links to them) are skipped and listed on stderr: reading one would hang or never end."""
    if not raw_inputs:
        raise UserInputError(
            "data.raw_inputs is empty; list the text/JSONL files or directories to prepare, "
            "e.g. data.raw_inputs=[corpus/]"
        )
    files, skipped = [], []
    for entry in raw_inputs:
        kind = _kind(entry)
        if kind == "dir":
            for root, dirs, names in os.walk(entry):
                dirs.sort()
                for name in sorted(names):
                    path = os.path.join(root, name)
                    if name.startswith("."):
                        continue
                    (files if _kind(path) == "file" else skipped).append(path)
        elif kind == "file":
            files.append(entry)
        elif kind == "missing":
            raise UserInputError(f"data.raw_inputs: {entry} does not exist; give existing files or directories")
        else:
            raise UserInputError(
                f"data.raw_inputs: {entry} is not a regular file or directory (a FIFO, device or socket); "
                "give the files to read"
            )
    if skipped:
        shown = ", ".join(skipped[:5]) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")  # noqa: PLR2004
        print(
            f"warning: data.raw_inputs: skipped {len(skipped)} entries that are not regular files: {shown}",
            file=sys.stderr,
            flush=True,
        )
    if not files:
        raise UserInputError(f"data.raw_inputs={list(raw_inputs)} contains no regular files")
    return files


def _kind(path: str) -> str:
    """'file', 'dir', 'missing' (or a dangling link) or 'special', symlinks followed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "special"


def iter_documents(files: Sequence[str], max_bytes: int = 256 << 20) -> Iterator[str]:
    """Each file's documents; a document (a text file, one JSONL line) over `max_bytes` is refused
    before it is read whole (data.max_document_mb)."""

    def too_long(where: str) -> UserInputError:
        return UserInputError(
            f"data.raw_inputs: {where} is longer than data.max_document_mb={max_bytes >> 20}; split it, "
            "or raise data.max_document_mb (tokenizing a document takes ~8x its size in memory)"
        )

    for path in files:
        if path.endswith(JSONL_SUFFIXES):
            with open(path, "rb") as f:
                number = 0
                while raw := f.readline(max_bytes + 1):
                    number += 1
                    if len(raw) > max_bytes:
                        raise too_long(f"{path}:{number}")
                    text = _json_text(path, number, raw)
                    if text is not None:  # a blank line is no document
                        yield text
        else:
            if os.path.getsize(path) > max_bytes:
                raise too_long(path)
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def _json_text(path: str, number: int, raw: bytes) -> Optional[str]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserInputError(
            f"data.raw_inputs: {path}:{number} is not valid UTF-8 (byte {exc.start} "
            f"of the line: {exc.reason}); convert the file to UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UserInputError(
            f"data.raw_inputs: {path}:{number} is not JSON ({getattr(exc, 'msg', 'nested too deep')}); "
            "JSONL needs one object per line"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserInputError(f"data.raw_inputs: {path}:{number} has no string 'text' field; every JSONL line needs one")
    return record["text"]


# [Note: long documents]
# The tokenizer's memory grows steeply with the length of one input string (a single 6 MB JSONL
# line took 1.4 GB to train on and encode; 50 MB, ~10 GB). A document longer than PIECE_CHARS is
# therefore handled in pieces cut just before a space: the byte-level BPE's pre-tokenizer splits at
# the same place (a word keeps its leading space), so the ids are the same as for the whole
# document, and memory stays bounded by the piece, not the document. Batches are bounded in
# characters too.
PIECE_CHARS = 200_000
_BATCH_CHARS = 4_000_000


def pieces(text: str, limit: int = 0) -> List[str]:
    """`text` cut before spaces into pieces of at most `limit` (default PIECE_CHARS) characters (a
    piece without a space in its second half is cut at the limit)."""
    limit = limit or PIECE_CHARS
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while start < len(text):
        end = min(start + limit, len(text))
        if end < len(text):
            cut = text.rfind(" ", start + limit // 2, end)
            end = cut if cut > start else end
        out.append(text[start:end])
        start = end
    return out


def _all_pieces(docs: Iterator[str]) -> Iterator[str]:
    for doc in docs:
        yield from pieces(doc)


# [Note: a document's special tokens]
# A document is encoded as `tokenizer(document)` encodes it ([Note: the tokenizer's own special
# tokens] in framework/data/tokenizer.py), then followed by the end-of-document id: a Llama, Mistral
# or Gemma tokenizer gives <bos> document <eos>, as Megatron-LM's data preprocessing tool gives with
# a Hugging Face tokenizer and --append-eod, and as transformers' causal-LM example (run_clm) gives
# (a BOS per document) once an EOS ends each. A tokenizer whose post-processor already ends the text
# with the end-of-document id gets no second one; one that adds nothing (GPT-2 style byte-level
# BPEs, the BPE trained here) gives the ids it always gave, so data prepared before is unchanged.


def encode_documents(tok, docs: List[str]):
    """Token ids of each document ([Note: a document's special tokens]) followed by the
    end-of-document id, as int64 arrays; long documents are encoded piecewise (see [Note: long
    documents]), the tokenizer's special tokens put around the whole."""
    import numpy

    prefix, suffix = list(getattr(tok, "special_prefix", [])), list(getattr(tok, "special_suffix", []))
    tail = [] if suffix[-1:] == [tok.eod] else [tok.eod]
    if all(len(d) <= PIECE_CHARS for d in docs):
        return [numpy.asarray(list(ids) + tail, dtype=numpy.int64) for ids in tok.encode_batch(docs, specials=True)]
    out = []
    for doc in docs:
        parts = [numpy.asarray(tok.encode_batch([part])[0], dtype=numpy.int64) for part in pieces(doc)]
        ends = [numpy.asarray(prefix, dtype=numpy.int64)], [numpy.asarray(suffix + tail, dtype=numpy.int64)]
        out.append(numpy.concatenate(ends[0] + parts + ends[1]))
    return out


def _batches(docs: Iterator[str]) -> Iterator[List[str]]:
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) == _BATCH or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from framework.data.tokenizer import BPETokenizer

    _worker_tokenizer = BPETokenizer(tokenizer_path)


def _encode(batch: List[str]) -> List[List[int]]:
    return encode_documents(_worker_tokenizer, batch)


def prepare(
    raw_inputs: Sequence[str],
    output_prefix: str,
    *,
    tokenizer: str = "",
    vocab_size: int = 2048,
    workers: int = 1,
    progress: bool = True,
    max_document_mb: int = 256,
) -> Tuple[str, str]:
    """Tokenize `raw_inputs` into `output_prefix`.bin/.idx; returns (prefix, tokenizer.json path).
    The outputs appear atomically (written under temporary names, renamed when complete)."""
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    from framework.data.tokenizer import BPETokenizer, train_bpe

    if not output_prefix:
        raise UserInputError("data.output_prefix is empty; set it to where <prefix>.bin/.idx should be written")
    files = input_files(raw_inputs)
    limit = max_document_mb << 20
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    if tokenizer:
        tok = BPETokenizer(tokenizer)
        _record_tokenizer(tok.path, output_prefix + ".tokenizer.json")
    else:
        tok = train_bpe(_all_pieces(iter_documents(files, limit)), vocab_size, output_prefix + ".tokenizer.json")
    dtype = DType.optimal_dtype(tok.vocab_size)
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    for suffix in (".bin", ".idx"):  # megatron opens them by name: our own files, never a planted link
        create_temporary(tmp + suffix, "wb").close()
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    bar = tqdm(unit="doc", desc="tokenizing", disable=not progress, file=sys.stderr, mininterval=0.5)
    pool = None
    if workers > 1:
        import multiprocessing as mp

        # The parent used the Rust thread pool (training); forked children must not.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok.path,))
        encoded = pool.imap(_encode, _batches(iter_documents(files, limit)), chunksize=1)
    else:
        encoded = (encode_documents(tok, b) for b in _batches(iter_documents(files, limit)))
    try:
        n_docs = n_tokens = 0
        for batch in encoded:
            for ids in batch:  # each ends with the end-of-document id
                builder.add_item(torch.from_numpy(ids))
                builder.end_document()
                n_tokens += len(ids)
            n_docs += len(batch)
            bar.update(len(batch))
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    builder.finalize(tmp + ".idx")
    os.replace(tmp + ".bin", output_prefix + ".bin")
    os.replace(tmp + ".idx", output_prefix + ".idx")  # the .idx last: its presence means complete
    print(
        f"prepared {output_prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens, "
        f"vocab {tok.vocab_size} ({tok.path})",
        file=sys.stderr,
        flush=True,
    )
    return output_prefix, tok.path


def _record_tokenizer(source: str, path: str) -> None:
    """A copy of the tokenizer `source` next to the data it tokenized, so the data names its
    tokenizer whatever tokenized it (training reads it without data.tokenizer, and compares it
    with a model's: [Note: the data's tokenizer against the model's] in framework/data/tokenizer.py)."""
    from framework.fileio import copy_file

    if os.path.exists(path) and os.path.samefile(source, path):
        return
    copy_file(source, path)


def prepare_data(cfg) -> int:
    """The data_preparation stage; returns the exit status (EXIT_BAD_INPUT for bad input)."""
    d = cfg.data
    try:
        prepare(
            d.raw_inputs,
            d.output_prefix,
            tokenizer=d.tokenizer,
            vocab_size=d.vocab_size,
            workers=d.workers,
            progress=cfg.trainer.progress_bar is not False and (cfg.trainer.progress_bar or sys.stderr.isatty()),
            max_document_mb=d.max_document_mb,
        )
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


def default_tokenizer_for(prefix: str) -> Optional[str]:
    """The tokenizer.json data preparation wrote next to `prefix`, if any."""
    path = prefix + ".tokenizer.json"
    return path if os.path.isfile(path) else None
