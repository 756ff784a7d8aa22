"""data=hf: Hugging Face `datasets` from local files, tokenized and packed like our indexed data.

    python main.py data=hf data.paths=[corpus.parquet] data.tokenizer=<tokenizer dir or .json>
    python main.py data=hf data.paths=[a.jsonl,b.parquet] data.weights=[0.7,0.3] data.hf.streaming=true

A path is a parquet, JSONL/JSON, arrow, CSV or text file, a directory of such files (one format),
or a `save_to_disk` directory. A record becomes one document: its text column, else its chat
column (the tokenizer's chat template, else `<|role|>` lines), else prompt + response; a text is
encoded as `tokenizer(text)` encodes it (the tokenizer's BOS first, where it adds one: [Note: a
document's special tokens] in framework/data/prepare.py) and each document ends with the
tokenizer's end-of-document id.

[Note: one global row order, whatever the world size]
The documents of each path, end to end, are cut into rows of seq_len + 1 tokens, each row starting
where the previous one's last input token was (as Megatron's GPT dataset does). Several paths are
mixed row by row by their weights: row k comes from the path furthest behind its share (w_j * (k+1)
- rows_j, lowest index on ties), so the mixture is exact at every prefix. Global row k is what the
loader calls sample k ([Note: global sample order] in loader.py); every data-parallel rank walks
the same global sequence and keeps the rows it is given, so a rank's rows do not depend on how
many ranks there are. A checkpoint stores, at the step's first unconsumed row, each path's cursor
(epoch, document, token offset) and row count: a resume, at any world size, rebuilds exactly the
sequence a straight run would have read (tested: 12 steps = 6 + resume + 6, and 6 on 2 ranks + 6
on 1). Not streaming, the documents of each epoch come in a seeded shuffled order; streaming, in
file order (a shuffle buffer could not be restored exactly), reading only what the rows need.

The cost of that exactness: every data-parallel rank tokenizes the whole global stream, not just
its 1/dp of it. Tokenizing runs at millions of tokens per second per core, so this is small next to
training up to a few dozen data-parallel ranks; beyond that, tokenize once with
`stage=data_preparation` and train on data=indexed, which reads only each rank's rows.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from framework.errors import UserInputError

FORMATS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_BATCH = 64  # documents tokenized together


def open_dataset(path: str, streaming: bool, cache_dir: str):
    """The records of one `data.paths` entry: a datasets.Dataset, or an IterableDataset when
    streaming."""
    from framework.offline import hub_offline

    hub_offline()  # local files only: [Note: offline whatever the environment says]
    try:
        import datasets
    except ImportError as exc:
        raise UserInputError(
            f"data=hf needs the datasets package ({exc}): "
            "pip install -r requirements-tools.lock (make venv installs it)"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    if not os.path.exists(path):
        hub_like = not path.startswith((".", "/", "~")) and path.count("/") <= 1
        why = (
            "names no local file: this job reads no model or dataset hub; download it elsewhere (e.g. "
            "`datasets.load_dataset(...).save_to_disk(dir)`) and give the local path"
            if hub_like
            else "does not exist"
        )
        raise UserInputError(f"data.paths: {path} {why}")
    if os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _SAVED_MARKERS):
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise UserInputError(f"data.paths: {path} holds splits {sorted(ds)} but no 'train' split")
            ds = ds["train"]
        return ds.to_iterable_dataset() if streaming else ds
    files = _data_files(path)
    builder = {FORMATS[os.path.splitext(f)[1].lower()] for f in files}
    if len(builder) != 1:
        raise UserInputError(f"data.paths: {path} mixes formats {sorted(builder)}; give one path per format")
    try:
        return datasets.load_dataset(
            builder.pop(),
            data_files=files,
            split="train",
            streaming=streaming,
            cache_dir=os.path.join(os.path.abspath(cache_dir), "hf_datasets"),
        )
    except (ValueError, OSError, TypeError) as exc:
        raise UserInputError(
            f"data.paths: {path} could not be read as a dataset ({type(exc).__name__}: {exc})"
        ) from None


def _data_files(path: str) -> List[str]:
    if os.path.isfile(path):
        candidates = [path]
    else:
        candidates = sorted(
            os.path.join(root, name) for root, _, names in os.walk(path) for name in names if not name.startswith(".")
        )
    files = [f for f in candidates if os.path.splitext(f)[1].lower() in FORMATS and os.path.isfile(f)]
    if not files:
        raise UserInputError(
            f"data.paths: {path} holds no {', '.join(sorted(FORMATS))} file and is no save_to_disk directory"
        )
    return files


class RecordText:
    """One record -> the text of its document, by data.hf's field settings."""

    def __init__(self, hf_cfg, path: str, columns: Optional[Sequence[str]]):
        self.cfg, self.path = hf_cfg, path
        if columns is not None:
            usable = (hf_cfg.text_field, hf_cfg.messages_field)
            if not any(c in columns for c in usable) and not {hf_cfg.prompt_field, hf_cfg.response_field} <= set(
                columns
            ):
                raise UserInputError(
                    f"data.paths: {path} has columns {list(columns)}, none of them data.hf.text_field="
                    f"{hf_cfg.text_field!r}, messages_field={hf_cfg.messages_field!r} or prompt_field/response_field; "
                    "set data.hf.text_field=<the text column>"
                )

    def __call__(self, record: dict, tok):
        """The record's text (a str, tokenized in batches by the caller) or, through a chat
        template, its token ids."""
        c = self.cfg
        text = record.get(c.text_field)
        if isinstance(text, str):
            return text
        messages = record.get(c.messages_field)
        if isinstance(messages, list) and messages:
            if tok.has_chat_template:
                return list(tok.chat_ids(messages))
            return "".join(f"<|{m.get('role', 'user')}|>\n{m.get('content', '')}\n" for m in messages)
        prompt, response = record.get(c.prompt_field), record.get(c.response_field)
        if isinstance(prompt, str) and isinstance(response, str):
            return prompt + response
        raise UserInputError(
            f"data.paths: a record of {self.path} has no string {c.text_field!r}, no {c.messages_field!r} list "
            f"and no {c.prompt_field!r}/{c.response_field!r} strings (its keys: {sorted(record)})"
        )


class Documents:
    """The token ids of one path's documents, endlessly: epoch after epoch, from any (epoch, index).
    The first `held_out` documents are the validation set and never part of training."""

    def __init__(self, ds, to_ids, tok, *, streaming: bool, shuffle: bool, seed: int, held_out: int):
        self.ds, self.to_ids, self.tok = ds, to_ids, tok
        self.streaming, self.shuffle, self.seed, self.held_out = streaming, shuffle and not streaming, seed, held_out
        if not streaming:
            self.count = len(ds) - held_out
            if self.count <= 0:
                raise UserInputError(
                    f"data.paths: a dataset has {len(ds)} records, no more than data.hf.valid_documents={held_out}; "
                    "give more records or lower data.hf.valid_documents"
                )

    def _ids(self, records: list) -> List[List[int]]:
        """Token ids of each record, its end-of-document id last; texts are tokenized together."""
        out = [self.to_ids(r, self.tok) for r in records]
        texts = [i for i, x in enumerate(out) if isinstance(x, str)]
        if texts:
            for i, ids in zip(texts, self.tok.encode_batch([out[i] for i in texts], specials=True)):
                out[i] = ids
        suffix = list(getattr(self.tok, "special_suffix", []))
        tail = [] if suffix[-1:] == [self.tok.eod] else [self.tok.eod]  # a post-processor's EOS is not doubled
        return [list(ids) + tail for ids in out]

    def validation(self) -> List[List[int]]:
        records = self.ds.take(self.held_out) if self.streaming else self.ds.select(range(self.held_out))
        return self._ids(list(records))

    def _batched(self, records, epoch: int, index: int):
        batch: list = []
        for record in records:
            batch.append(record)
            if len(batch) == _BATCH:
                for ids in self._ids(batch):
                    yield epoch, index, ids
                    index += 1
                batch = []
        for ids in self._ids(batch) if batch else ():
            yield epoch, index, ids
            index += 1

    def _order(self, epoch: int):
        if not self.shuffle:
            return None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.count, generator=g).tolist()

    def iterate(self, epoch: int, index: int) -> Iterator[Tuple[int, int, List[int]]]:
        """(epoch, index, token ids) from document `index` of `epoch` on, for ever."""
        while True:
            produced = False
            if self.streaming:
                records = iter(self.ds.skip(self.held_out + index))
            else:
                order = self._order(epoch)
                records = (self.ds[self.held_out + (order[i] if order else i)] for i in range(index, self.count))
            for item in self._batched(records, epoch, index):
                produced = True
                yield item
            if not produced and index == 0:
                raise UserInputError(
                    "data.paths: a streamed dataset has no documents after the "
                    f"data.hf.valid_documents={self.held_out} held out for validation"
                )
            epoch, index = epoch + 1, 0


class PackedRows:
    """One path's documents end to end, cut into rows of seq_len + 1 tokens (consecutive rows share
    one token). `cursor()` is where the next row starts; `seek(cursor)` goes back there."""

    def __init__(self, documents: Documents, seq_len: int):
        self.documents, self.seq_len = documents, seq_len
        self.seek({"epoch": 0, "document": 0, "offset": 0})

    def seek(self, cursor: dict) -> None:
        self._docs = self.documents.iterate(int(cursor["epoch"]), int(cursor["document"]))
        self._buffer: List[int] = []
        self._spans: deque = deque()  # (epoch, document, first offset, tokens) behind _buffer, in order
        self._fill(1)
        epoch, document, _, ids = self._spans[0]
        offset = int(cursor["offset"])
        if not 0 <= offset < len(ids):
            raise UserInputError(
                f"the checkpoint's data cursor {cursor} does not fit this data: resume with the same data.paths"
            )
        del self._buffer[:offset]
        self._spans[0] = (epoch, document, offset, ids[offset:])

    def _fill(self, need: int) -> None:
        while len(self._buffer) < need:
            epoch, document, ids = next(self._docs)
            self._spans.append((epoch, document, 0, ids))
            self._buffer.extend(ids)

    def cursor(self) -> dict:
        epoch, document, offset, _ = self._spans[0]
        return {"epoch": epoch, "document": document, "offset": offset}

    def next_row(self) -> torch.Tensor:
        self._fill(self.seq_len + 1)
        row = torch.tensor(self._buffer[: self.seq_len + 1], dtype=torch.long)
        drop = self.seq_len
        del self._buffer[:drop]
        while drop:
            epoch, document, offset, ids = self._spans[0]
            if len(ids) <= drop:
                drop -= len(ids)
                self._spans.popleft()
            else:
                self._spans[0] = (epoch, document, offset + drop, ids[drop:])
                drop = 0
        self._fill(1)  # the span of the next row's first token
        return row


class MixedRows:
    """Global rows of several paths mixed by weight ([Note: one global row order, whatever the
    world size]); read in increasing index order, as the loader does."""

    def __init__(self, sources: List[PackedRows], weights: Sequence[float]):
        total = float(sum(weights))
        self.sources, self.weights = sources, [w / total for w in weights]
        self.counts = [0] * len(sources)
        self.next_index = 0
        self._last: Tuple[int, Optional[torch.Tensor]] = (-1, None)

    def __len__(self) -> int:
        return 1 << 62  # endless: the documents start over with the next epoch

    def _pick(self) -> int:
        k = self.next_index + 1
        deficits = [w * k - c for w, c in zip(self.weights, self.counts)]
        return max(range(len(deficits)), key=lambda j: (deficits[j], -j))

    def _advance(self) -> torch.Tensor:
        j = self._pick()
        row = self.sources[j].next_row()
        self.counts[j] += 1
        self.next_index += 1
        return row

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self._last[0]:
            return self._last[1]
        if index < self.next_index:
            raise IndexError(f"row {index} was passed (streamed rows are read in order; next is {self.next_index})")
        while self.next_index < index:
            self._advance()
        row = self._advance()
        self._last = (index, row)
        return row

    def position_at(self, consumed: int) -> dict:
        """The cursor of global row `consumed` (the first a resume reads), after reading up to it."""
        if consumed < self.next_index:
            raise RuntimeError(f"data position {consumed} is behind the stream ({self.next_index})")
        while self.next_index < consumed:
            self._advance()
        return {"row": consumed, "counts": list(self.counts), "cursors": [s.cursor() for s in self.sources]}

    def seek(self, position: dict, consumed: int) -> None:
        try:
            cursors, counts, row = position["cursors"], [int(c) for c in position["counts"]], int(position["row"])
            ok = len(cursors) == len(self.sources) == len(counts) and row == consumed == sum(counts)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise UserInputError(
                f"the checkpoint's data position {position!r} is not one of these {len(self.sources)} data.paths "
                f"at sample {consumed}: resume with the data.paths and weights it was saved with"
            )
        for source, cursor in zip(self.sources, cursors):
            source.seek(cursor)
        self.counts, self.next_index, self._last = counts, row, (-1, None)


class RowList:
    """The validation rows, in memory."""

    def __init__(self, rows: List[torch.Tensor]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def build_hf(cfg, req, tok):
    """(train source, validation source) of data=hf for this rank."""
    if not cfg.paths:
        raise UserInputError("data=hf needs data.paths=[<parquet/JSONL/arrow file or dataset directory>, ...]")
    weights = list(cfg.weights) or [1.0] * len(cfg.paths)
    sources, valid_rows = [], []
    for number, path in enumerate(cfg.paths):
        ds = open_dataset(path, cfg.hf.streaming, cfg.cache_dir)
        columns = getattr(ds, "column_names", None)
        to_ids = RecordText(cfg.hf, path, columns)
        documents = Documents(
            ds,
            to_ids,
            tok,
            streaming=cfg.hf.streaming,
            shuffle=cfg.hf.shuffle,
            seed=req.seed + number,
            held_out=cfg.hf.valid_documents,
        )
        valid_rows += _pack_all(documents.validation(), cfg.seq_len)
        sources.append(PackedRows(documents, cfg.seq_len))
    if not valid_rows:
        raise UserInputError(
            f"data.hf.valid_documents={cfg.hf.valid_documents} documents hold fewer than data.seq_len+1="
            f"{cfg.seq_len + 1} tokens: raise data.hf.valid_documents"
        )
    return MixedRows(sources, weights), RowList(valid_rows)


def _pack_all(documents: List[List[int]], seq_len: int) -> List[torch.Tensor]:
    flat = [t for ids in documents for t in ids]
    return [torch.tensor(flat[i : i + seq_len + 1]) for i in range(0, len(flat) - seq_len, seq_len)]
