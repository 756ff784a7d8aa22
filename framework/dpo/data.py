"""The data of `stage=dpo`: preference records read through data=hf -> rows of a chosen and a
rejected sequence whose labels are the reply's tokens only.

A record holds a prompt and two replies (column names: data.hf.prompt_field, dpo.chosen_field,
dpo.rejected_field), in one of the forms TRL reads:

    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}                     plain text
    {"prompt": [{"role": "user", "content": "2 + 2?"}],
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}          chat (a reply may be a string)
    {"chosen": [user turn, assistant turn], "rejected": [user turn, other turn]}  chat, prompt implicit

Plain text is tokenized as TRL's DPOTrainer tokenizes it, as fine-tuning's {"prompt", "response"}
records are ([Note: prompt and reply are encoded together] in framework/finetune/data.py): prompt +
reply + the end-of-document token as one text, as `tokenizer(text)` gives it (its BOS included); the
reply's tokens start where the prompt's own encoding parts from both joint ones (the chosen's and
the rejected's: TRL takes the shorter common prefix for the pair). Chat is rendered by the
tokenizer's chat template when it has one: the reply's tokens are those the rendering of prompt +
reply adds after the rendering of the prompt with its generation prompt, again from where it parts
from both (without a template, the fine-tuning's plain `<|role|>` lines, the BOS once first). Each
pair becomes one row of two sequences, `input_ids` and `labels` of shape (2, data.seq_len): chosen
first, rejected second, padded at the end; a label is -100 everywhere but on the reply's tokens, so
the log-probabilities summed over labelled positions are the reply's given the prompt.
"""

from __future__ import annotations

import sys

import torch

from framework.config.schema import Config
from framework.data.loader import DataBundle
from framework.errors import UserInputError
from framework.finetune.data import Document, common_prefix, encode_replies, pad_rows


def _is_messages(value) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


def _turns(value) -> list:
    """A reply or prompt as chat turns: a string is one assistant turn (a reply)."""
    return [{"role": "assistant", "content": value}] if isinstance(value, str) else [dict(m) for m in value]


def encode_chat(prompt: list, replies: list, tok) -> list:
    """prompt + each reply rendered as one conversation; the replies' tokens are the trained ones,
    starting where the prompt's rendering (with its generation prompt) parts from both."""
    if tok.has_chat_template:
        joint = [tok.chat_ids(prompt + reply) for reply in replies]
        prompt_ids = tok.chat_ids(prompt, add_generation_prompt=True)
        start = min(common_prefix(prompt_ids, ids) for ids in joint)
        return [Document(ids, [i >= start for i in range(len(ids))]) for ids in joint]
    return [_builtin_chat(prompt, reply, tok) for reply in replies]


def _builtin_chat(prompt: list, reply: list, tok) -> Document:
    """The built-in `<|role|>` lines, each turn tokenized apart, the tokenizer's BOS once first."""
    ids, train = list(tok.special_prefix), [False] * len(tok.special_prefix)
    for index, message in enumerate(prompt + reply):
        header = tok.encode(f"<|{message['role']}|>\n")
        body = tok.encode(message["content"]) + [tok.eod]
        ids += header + body
        train += [False] * len(header) + [index >= len(prompt)] * len(body)
    return Document(ids, train)


def encode_pair(record, tok, prompt_field: str, chosen_field: str, rejected_field: str, where: str):
    """(chosen, rejected) documents of one preference record; anything else is refused naming
    `where` (the file and the record's number)."""
    if not isinstance(record, dict):
        raise UserInputError(f"{where}: not a record (an object of {prompt_field}, {chosen_field}, {rejected_field})")
    prompt, chosen, rejected = record.get(prompt_field), record.get(chosen_field), record.get(rejected_field)
    if isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        return tuple(encode_replies(prompt, [chosen, rejected], tok))
    replies_ok = all(isinstance(r, str) or _is_messages(r) for r in (chosen, rejected))
    if prompt is None and _is_messages(chosen) and _is_messages(rejected):  # the prompt: the shared leading turns
        shared = common_prefix(chosen, rejected)
        if shared and shared < min(len(chosen), len(rejected)):
            return tuple(encode_chat(chosen[:shared], [chosen[shared:], rejected[shared:]], tok))
    elif replies_ok and (_is_messages(prompt) or isinstance(prompt, str)):
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _turns(prompt)
        return tuple(encode_chat(turns, [_turns(chosen), _turns(rejected)], tok))
    raise UserInputError(
        f"{where}: a preference record needs strings {prompt_field!r}, {chosen_field!r} and {rejected_field!r}, or "
        f"chat turns (lists of {{role, content}}) for them (without {prompt_field!r}: {chosen_field!r} and "
        f"{rejected_field!r} conversations sharing their first turns); its keys: {sorted(record)}"
    )


def pair_rows(pairs: list, seq_len: int, pad_id: int) -> list:
    """One row per pair: `input_ids` and `labels` of shape (2, seq_len), chosen then rejected. A
    pair either of whose replies has no token within seq_len is left out."""
    rows = []
    for chosen, rejected in pairs:
        both = [pad_rows([doc], seq_len, pad_id) for doc in (chosen, rejected)]
        if all(both):
            rows.append({key: torch.stack([both[0][0][key], both[1][0][key]]) for key in ("input_ids", "labels")})
    return rows


def read_pairs(cfg: Config, tok) -> list:
    """(chosen, rejected) documents of every record of data.paths, path after path."""
    from framework.data.hf_data import open_dataset

    h, d = cfg.data.hf, cfg.dpo
    pairs = []
    for path in cfg.data.paths:
        ds = open_dataset(path, False, cfg.data.cache_dir)
        missing = [c for c in (d.chosen_field, d.rejected_field) if c not in ds.column_names]
        if missing:
            raise UserInputError(
                f"data.paths: {path} has columns {list(ds.column_names)}, not {', '.join(map(repr, missing))}; "
                "name its columns with dpo.chosen_field, dpo.rejected_field (and data.hf.prompt_field)"
            )
        for number, record in enumerate(ds, 1):
            pairs.append(
                encode_pair(record, tok, h.prompt_field, d.chosen_field, d.rejected_field, f"{path}: record {number}")
            )
    return pairs


def build_dpo_data(cfg: Config, *, dp_rank: int, dp_size: int) -> DataBundle:
    """The two loaders of a DPO job: the first data.hf.valid_documents pairs are the validation
    set, the rest the training set in a seeded order (trainer.seed)."""
    from framework.finetune.build import _check_ids_fit, global_loaders, held_out_split, post_training_tokenizer

    tok, main = post_training_tokenizer(cfg, "dpo")
    rows = pair_rows(read_pairs(cfg, tok), cfg.data.seq_len, pad_id=tok.eod)
    refusal = (
        f"stage=dpo: {len(rows)} pairs have reply tokens within data.seq_len={cfg.data.seq_len}, no more than "
        f"data.hf.valid_documents={cfg.data.hf.valid_documents} (the validation pairs); give more records, lower "
        "data.hf.valid_documents or raise data.seq_len"
    )
    train, valid = held_out_split(rows, cfg, refusal)
    _check_ids_fit(cfg, tok, rows)
    if main:
        print(
            f"dpo: {len(train)} training and {len(valid)} validation pairs, tokenizer {tok.path or '(built in)'} "
            f"({tok.vocab_size} ids{', its chat template' if tok.has_chat_template else ''})",
            file=sys.stderr,
            flush=True,
        )
    loaders = global_loaders(cfg, train, valid, dp_rank=dp_rank, dp_size=dp_size)
    return DataBundle(*loaders, vocab_size=tok.vocab_size, tokenizer=tok)
