"""`data=stdlib`, the main job's embedded corpus: this Python's own standard-library sources.

The corpus is the top-level `*.py` files of `sysconfig.get_paths()['stdlib']` in name order, up
to STDLIB_BYTES (about half of them: it prepares in seconds, yet is enough text for a small GPT).
It is prepared once through the same path as `stage=data_preparation` into
`<data.cache_dir>/stdlib-<python version>-<vocab>/` (a BPE of data.vocab_size trained on it), or
`...-t<its sha256>/` with a given tokenizer (data.tokenizer, else a Hugging Face model's own: see
[Note: the data's tokenizer against the model's] in framework/data/tokenizer.py), and reused by
every later run: rank 0 prepares while the others wait at a barrier, and the finished directory
appears by one rename.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from typing import List

STDLIB_BYTES = 2_000_000
CORPUS_REVISION = 2  # part of the cache directory's name: bump it when the selection changes
DOC_CHARS = 4_000  # characters per document, at most (roughly)


def stdlib_files(limit: int = STDLIB_BYTES) -> List[str]:
    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        # Private modules are skipped: some are generated tables (_sysconfigdata_*), not code.
        if not name.endswith(".py") or name.startswith("_") or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        if total + size > limit and files:
            break
        files.append(path)
        total += size
    return files


def write_documents(files: List[str], out_path: str, max_chars: int = DOC_CHARS) -> None:
    """The files as JSONL documents of at most ~`max_chars`, cut at line boundaries: whole files
    (73 of them) are too few documents for a 98/1/1 train/valid/test split."""
    from framework.fileio import create_temporary

    with create_temporary(out_path) as out:
        for path in files:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
            chunk: List[str] = []
            size = 0
            for line in lines + [None]:
                if line is None or (size + len(line) > max_chars and chunk):
                    if chunk:
                        out.write(json.dumps({"text": "".join(chunk)}) + "\n")
                    chunk, size = [], 0
                if line is not None:
                    chunk.append(line)
                    size += len(line)


def stdlib_prefix(cache_dir: str, vocab_size: int, tokenizer: str = "") -> str:
    """Where the corpus is prepared: named by its BPE's size, or by the content of the tokenizer
    it is prepared with (`tokenizer`, a tokenizer.json)."""
    import hashlib

    version = "%d.%d" % sys.version_info[:2]
    if tokenizer:
        from framework.data.tokenizer import BPETokenizer

        with open(tokenizer, "rb") as f:
            which = "t" + hashlib.sha256(f.read()).hexdigest()[:16]
        if BPETokenizer(tokenizer).unique_identifiers.get("specials"):  # documents begin with its BOS: not
            which += "-s"  # the ids of a cache prepared before they were added ([Note: a document's special tokens])
    else:
        which = f"v{vocab_size}"
    return os.path.join(os.path.abspath(cache_dir), f"stdlib-r{CORPUS_REVISION}-py{version}-{which}", "stdlib")


def ensure_stdlib(cache_dir: str, vocab_size: int, workers: int, *, is_main: bool, barrier, tokenizer: str = "") -> str:
    """The prefix of the prepared stdlib corpus, preparing it first (rank 0) if needed: with a BPE of
    `vocab_size` trained on it, or with `tokenizer` (a tokenizer.json: a model's own)."""
    from framework.data.prepare import prepare

    prefix = stdlib_prefix(cache_dir, vocab_size, tokenizer)
    final = os.path.dirname(prefix)
    if is_main and not os.path.isfile(prefix + ".idx"):
        tmp = f"{final}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"preparing the stdlib corpus once into {final}", file=sys.stderr, flush=True)
        os.makedirs(tmp)
        corpus = os.path.join(tmp, "corpus.jsonl")
        write_documents(stdlib_files(), corpus)
        prepare(
            [corpus],
            os.path.join(tmp, "stdlib"),
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            workers=workers,
            progress=False,
        )
        os.remove(corpus)
        try:
            os.rename(tmp, final)
        except OSError:  # another job finished first: use theirs
            shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    return prefix
