"""Supervised fine-tuning data: JSONL records -> rows of token ids with the loss on responses only.

A record is one line of JSON, either

    {"prompt": "...", "response": "..."}
    {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}

Each record becomes one document: its token ids and, per token, the label the model must predict
there (the next token), or -100 where nothing is learned. Only response tokens (and the
end-of-document token after each response) carry labels; prompt, system and user tokens are -100,
so they shape the context but not the loss. Chat records use the tokenizer's own chat template
when it has one (a Hugging Face tokenizer directory with `chat_template`), else a plain built-in
one (`<|role|>` lines).

[Note: prompt and reply are encoded together]
A {"prompt", "response"} record is encoded as TRL's SFTTrainer encodes a prompt-completion record
(and its DPOTrainer a preference pair): the text prompt + response + the end-of-document token
(appended as text unless the response already ends with it) is tokenized as one, as
`tokenizer(text)` gives it (the tokenizer's BOS first, where it adds one: [Note: the tokenizer's
own special tokens] in framework/data/tokenizer.py); the prompt alone is tokenized the same way,
and the trained tokens start where the two encodings part. Tokenized apart, a prompt ending
inside a pre-token ("x = " before "1") would give ids the model never reads at inference (a lone
space token, then "1" without its space); tokenized together, the tokens that straddle the
boundary belong to the response (tested equal to TRL's ids and completion mask). Without a
template, chat records are the built-in `<|role|>` lines, each turn tokenized apart, the
tokenizer's BOS once at the start.

[Note: packed rows keep documents apart]
With packing, documents are laid end to end in rows of `seq_len` tokens (first fit, in order; a
document longer than a row is cut). Each token carries its position inside its document and its
document's number in the row; the model attends only within a document and restarts the rotary
positions at each document's start, so a packed row computes exactly what the documents would
alone (tested: the logits are equal). Without packing each row holds one document, padded at the
end (labels -100): causal attention never looks ahead, so padding needs no mask.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from framework.data.tokenizer import SFTTokenizer, load_tokenizer  # noqa: F401  (re-exported)
from framework.errors import UserInputError

IGNORE_INDEX = -100
PAD_DOCUMENT = -1  # the document id of padding in a packed row


@dataclass
class Document:
    ids: list  # token ids of the whole record, ending with the end-of-document token
    train: list  # per token: True where the token is a response token (a prediction target)


def read_records(path: str) -> list:
    """The JSONL records of `path`; a line that is not a record is refused naming file and line."""
    if not os.path.isfile(path):
        what = (
            "is a directory"
            if os.path.isdir(path)
            else "is not a regular file (a FIFO, device or socket)"
            if os.path.exists(path)
            else "does not exist"
        )
        raise UserInputError(
            f'finetune: {path} {what}; give a JSONL file of {{"prompt", "response"}} or {{"messages": [...]}} records'
        )
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserInputError(
                    f"{path}:{number}: not valid UTF-8 (byte {exc.start} of the line); convert the file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserInputError(f"{path}:{number}: not JSON ({exc.msg}); each line must be one record") from None
            if not _valid(record):
                raise UserInputError(
                    f'{path}:{number}: a record needs string fields "prompt" and "response", '
                    'or "messages": a list of {"role", "content"} with an assistant turn'
                )
            records.append(record)
    if not records:
        raise UserInputError(f"finetune: {path} holds no records")
    return records


def _valid(record) -> bool:
    if not isinstance(record, dict):
        return False
    if "messages" in record:
        msgs = record["messages"]
        return (
            isinstance(msgs, list)
            and bool(msgs)
            and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in msgs
            )
            and any(m["role"] == "assistant" for m in msgs)
        )
    return isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str)


def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_replies(prompt: str, replies: list, tok: SFTTokenizer) -> list:
    """One document per reply: prompt + reply + the end-of-document token encoded as one text, as
    `tokenizer(text)` gives it (its BOS included), the trained tokens starting where the prompt's own
    encoding and the joint ones part ([Note: prompt and reply are encoded together])."""
    eos = tok.eos_text
    joint = []
    for reply in replies:
        if eos is None:  # no text encodes to the end-of-document id: it follows the text's ids
            joint.append(tok.encode(prompt + reply, specials=True) + [tok.eod])
        else:
            joint.append(tok.encode(prompt + (reply if reply.endswith(eos) else reply + eos), specials=True))
    prompt_ids = tok.encode(prompt, specials=True)
    start = min(common_prefix(prompt_ids, ids) for ids in joint)
    return [Document(ids, [i >= start for i in range(len(ids))]) for ids in joint]


def encode_record(record: dict, tok: SFTTokenizer) -> Document:
    """One record as a document: ids and which of them are response tokens."""
    if "messages" not in record:
        return encode_replies(record["prompt"], [record["response"]], tok)[0]
    if tok.has_chat_template:
        return _encode_with_template(record["messages"], tok)
    ids, train = list(tok.special_prefix), [False] * len(tok.special_prefix)
    for message in record["messages"]:
        header = tok.encode(f"<|{message['role']}|>\n")
        body = tok.encode(message["content"]) + [tok.eod]
        ids += header + body
        train += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    return Document(ids, train)


def _encode_with_template(messages: list, tok: SFTTokenizer) -> Document:
    """The template renders the whole conversation; an assistant turn's tokens are those the
    rendering up to and including it adds after the rendering up to its generation prompt."""
    ids = tok.chat_ids(messages)
    train = [False] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tok.chat_ids(messages[:index], add_generation_prompt=True))
        end = len(tok.chat_ids(messages[: index + 1]))
        for position in range(start, min(end, len(ids))):
            train[position] = True
    return Document(ids, train)


def _shifted(doc: Document, seq_len: int):
    """(inputs, labels) of a document for next-token prediction, cut to `seq_len`."""
    inputs = doc.ids[:-1][:seq_len]
    labels = [tok if learn else IGNORE_INDEX for tok, learn in zip(doc.ids[1:], doc.train[1:])][:seq_len]
    return inputs, labels


def pack(documents: list, seq_len: int, pad_id: int) -> list:
    """Rows of `seq_len` tokens, several documents per row (first fit in order): each row a dict
    of `input_ids`, `labels`, `positions` (inside the document) and `document_ids` ([Note: packed
    rows keep documents apart])."""
    rows: list = []  # each: list of (inputs, labels)
    room: list = []
    for doc in documents:
        inputs, labels = _shifted(doc, seq_len)
        if not inputs or all(label == IGNORE_INDEX for label in labels):
            continue  # nothing to learn (an empty or fully cut response)
        for index, free in enumerate(room):
            if free >= len(inputs):
                rows[index].append((inputs, labels))
                room[index] -= len(inputs)
                break
        else:
            rows.append([(inputs, labels)])
            room.append(seq_len - len(inputs))
    out = []
    for row in rows:
        ids, labels, positions, documents_ = [], [], [], []
        for number, (inputs, doc_labels) in enumerate(row):
            ids += inputs
            labels += doc_labels
            positions += range(len(inputs))
            documents_ += [number] * len(inputs)
        pad = seq_len - len(ids)
        out.append(
            {
                "input_ids": torch.tensor(ids + [pad_id] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
                "positions": torch.tensor(positions + [0] * pad),
                "document_ids": torch.tensor(documents_ + [PAD_DOCUMENT] * pad),
            }
        )
    return out


def pad_rows(documents: list, seq_len: int, pad_id: int) -> list:
    """One document per row, padded at the end to `seq_len` (cut when longer)."""
    out = []
    for doc in documents:
        inputs, labels = _shifted(doc, seq_len)
        if not inputs or all(label == IGNORE_INDEX for label in labels):
            continue
        pad = seq_len - len(inputs)
        out.append(
            {"input_ids": torch.tensor(inputs + [pad_id] * pad), "labels": torch.tensor(labels + [IGNORE_INDEX] * pad)}
        )
    return out


class RowSource:
    """A list of prepared rows (dicts of tensors), indexable like the token sources."""

    def __init__(self, rows: list):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def split_records(records: list, valid_fraction: float, seed: int):
    """(train, valid) by a seeded permutation; at least one record in each."""
    if len(records) < 2:
        raise UserInputError("finetune: at least 2 records are needed (one held out for validation)")
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    n_valid = min(len(records) - 1, max(1, round(len(records) * valid_fraction)))
    return [records[i] for i in order[n_valid:]], [records[i] for i in order[:n_valid]]


def build_rows(records: list, tok: SFTTokenizer, seq_len: int, packing: bool) -> list:
    documents = [encode_record(r, tok) for r in records]
    return (pack if packing else pad_rows)(documents, seq_len, pad_id=tok.eod)


def seq2seq_rows(records: list, tok: SFTTokenizer, source_len: int, target_len: int) -> list:
    """Rows for an encoder-decoder: the prompt is the encoder's input (cut to `source_len`, padded,
    with its attention mask), the response and the end-of-document token the decoder's labels
    (cut to `target_len`, padded with -100). The model shifts the labels right itself. Each is
    encoded as `tokenizer(text)` encodes it (a T5 tokenizer's own `</s>` after it, as transformers'
    seq2seq examples give); the end-of-document token is not doubled where it already ends one."""
    tail = [] if tok.special_suffix[-1:] == [tok.eod] else [tok.eod]
    out = []
    for record in records:
        if "messages" in record:
            raise UserInputError('a sequence-to-sequence model takes {"prompt", "response"} records, not chat')
        source = tok.encode(record["prompt"], specials=True)[:source_len]
        target = (tok.encode(record["response"], specials=True) + tail)[:target_len]
        out.append(
            {
                "input_ids": torch.tensor(source + [tok.eod] * (source_len - len(source))),
                "attention_mask": torch.tensor([1] * len(source) + [0] * (source_len - len(source))),
                "labels": torch.tensor(target + [IGNORE_INDEX] * (target_len - len(target))),
            }
        )
    return out
