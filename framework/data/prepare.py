"""`stage=data_preparation`: raw text / JSONL -> Megatron indexed datasets (<prefix>.bin/.idx).

    python main.py stage=data_preparation data.raw_inputs=[corpus/,more.jsonl] data.output_prefix=data/corpus

Every input file is one document, except JSONL (`.jsonl`/`.json`), where every line is a document
whose text is its `text` field; directories are walked in sorted order. Documents are tokenized by
`data.workers` processes with a byte-level BPE (`data.tokenizer`, or one of `data.vocab_size`
trained on the inputs and written to `<prefix>.tokenizer.json`), each followed by the end-of-
document token, and written with megatron-core's IndexedDatasetBuilder, so the result is the
same format NeMo and Megatron-LM read and write.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

import framework.data.megatron_quiet  # noqa: F401  (before any megatron.core import)
from framework.errors import EXIT_BAD_INPUT, UserInputError

JSONL_SUFFIXES = (".jsonl", ".json")
_BATCH = 64  # documents per task handed to a worker


def input_files(raw_inputs: Sequence[str]) -> List[str]:
    if not raw_inputs:
        raise UserInputError("data.raw_inputs is empty; list the text/JSONL files or directories to prepare, "
                             "e.g. data.raw_inputs=[corpus/]")
    files = []
    for entry in raw_inputs:
        if os.path.isdir(entry):
            for root, dirs, names in os.walk(entry):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        elif os.path.isfile(entry):
            files.append(entry)
        else:
            raise UserInputError(f"data.raw_inputs: {entry} does not exist; give existing files or directories")
    if not files:
        raise UserInputError(f"data.raw_inputs={list(raw_inputs)} contains no files")
    return files


def iter_documents(files: Sequence[str]) -> Iterator[str]:
    for path in files:
        if path.endswith(JSONL_SUFFIXES):
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise UserInputError(f"data.raw_inputs: {path}:{number} is not JSON ({exc.msg}); "
                                             "JSONL needs one object per line") from None
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise UserInputError(f"data.raw_inputs: {path}:{number} has no string 'text' field; "
                                             "every JSONL line needs one")
                    yield record["text"]
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def _batches(docs: Iterator[str]) -> Iterator[List[str]]:
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


_worker_tokenizer = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from framework.data.tokenizer import BPETokenizer

    _worker_tokenizer = BPETokenizer(tokenizer_path)


def _encode(batch: List[str]) -> List[List[int]]:
    return _worker_tokenizer.encode_batch(batch)


def prepare(raw_inputs: Sequence[str], output_prefix: str, *, tokenizer: str = "", vocab_size: int = 2048,
            workers: int = 1, progress: bool = True) -> Tuple[str, str]:
    """Tokenize `raw_inputs` into `output_prefix`.bin/.idx; returns (prefix, tokenizer.json path).
    The outputs appear atomically (written under temporary names, renamed when complete)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    from framework.data.tokenizer import BPETokenizer, train_bpe

    if not output_prefix:
        raise UserInputError("data.output_prefix is empty; set it to where <prefix>.bin/.idx should be written")
    files = input_files(raw_inputs)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    if tokenizer:
        tok = BPETokenizer(tokenizer)
    else:
        tok = train_bpe(iter_documents(files), vocab_size, output_prefix + ".tokenizer.json")
    dtype = DType.optimal_dtype(tok.vocab_size)
    tmp = f"{output_prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
    bar = tqdm(unit="doc", desc="tokenizing", disable=not progress, file=sys.stderr, mininterval=0.5)
    pool = None
    if workers > 1:
        import multiprocessing as mp

        # The parent used the Rust thread pool (training); forked children must not.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        pool = mp.get_context("fork").Pool(workers, initializer=_init_worker, initargs=(tok.path,))
        encoded = pool.imap(_encode, _batches(iter_documents(files)), chunksize=1)
    else:
        encoded = (tok.encode_batch(b) for b in _batches(iter_documents(files)))
    try:
        n_docs = n_tokens = 0
        for batch in encoded:
            for ids in batch:
                builder.add_item(torch.from_numpy(numpy.asarray(ids + [tok.eod], dtype=numpy.int64)))
                builder.end_document()
                n_tokens += len(ids) + 1
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
    print(f"prepared {output_prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens, "
          f"vocab {tok.vocab_size} ({tok.path})", file=sys.stderr, flush=True)
    return output_prefix, tok.path


def prepare_data(cfg) -> int:
    """The data_preparation stage; returns the exit status (EXIT_BAD_INPUT for bad input)."""
    d = cfg.data
    try:
        prepare(d.raw_inputs, d.output_prefix, tokenizer=d.tokenizer, vocab_size=d.vocab_size,
                workers=d.workers, progress=cfg.trainer.progress_bar)
    except UserInputError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return 0


def default_tokenizer_for(prefix: str) -> Optional[str]:
    """The tokenizer.json data preparation wrote next to `prefix`, if any."""
    path = prefix + ".tokenizer.json"
    return path if os.path.isfile(path) else None
