"""A byte-level BPE tokenizer (Hugging Face `tokenizers`), trained locally or read from a
tokenizer.json, with what our trainer needs (encode/decode) and what megatron-core's datasets
need (vocab_size, eod, unique_identifiers)."""

from __future__ import annotations

import functools
import hashlib
import os
from collections import OrderedDict
from typing import Iterable, List, Tuple

from framework.errors import UserInputError

EOD = "<|endoftext|>"  # ends every document in the prepared datasets


# [Note: the tokenizer's own special tokens]
# `tokenizer(text)` in transformers (and `Tokenizer.encode(text)` of a tokenizer.json) runs the
# tokenizer's post-processor: Llama 2/3, Mistral and Gemma put their BOS before the text, a few
# tokenizers an EOS after it, GPT-2 style byte-level BPEs (our locally trained one included) add
# nothing. A model learnt with those ids, so a whole text the model reads (an SFT record, a DPO
# pair, a GRPO or generate prompt, a pre-training document) is encoded with them: `encode(text,
# specials=True)`. Pieces that are laid end to end (lm-eval's contexts and continuations, the
# built-in `<|role|>` chat lines) are encoded without (`specials=False`, the default) and the
# document gets the prefix once (`special_prefix`). A tokenizer whose post-processor adds nothing
# gives the same ids either way, so data prepared with it does not change.


def special_ends(plain, full) -> Tuple[List[int], List[int]]:
    """(prefix, suffix): the ids a tokenizer's post-processor puts before and after a text's own,
    found by encoding a probe text without (`plain`) and with (`full`) them."""
    probe = "a b"
    bare, whole = list(plain(probe)), list(full(probe))
    for start in range(len(whole) - len(bare) + 1):
        if whole[start : start + len(bare)] == bare:
            return whole[:start], whole[start + len(bare) :]
    return [], []  # a post-processor that rewrites the text's own ids: none we know of


class BPETokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        if not os.path.isfile(path):
            raise UserInputError(
                f"data.tokenizer={path}: no such tokenizer.json; give an existing file "
                "or leave it empty to train a byte-level BPE"
            )
        self.path = os.path.abspath(path)
        self._tok = Tokenizer.from_file(self.path)
        eod = self._tok.token_to_id(EOD)
        if eod is None:  # a foreign tokenizer: use its first special token, else the last id
            specials = [t for t in ("</s>", "<|end_of_text|>", "<eos>") if self._tok.token_to_id(t) is not None]
            eod = self._tok.token_to_id(specials[0]) if specials else self._tok.get_vocab_size() - 1
        self.eod = eod
        with open(self.path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        # megatron-core hashes these into the names of its cached index files.
        self.unique_identifiers = OrderedDict(cls="BPETokenizer", sha256=digest)
        self.special_prefix, self.special_suffix = special_ends(self.encode, lambda t: self.encode(t, specials=True))
        if self.special_prefix or self.special_suffix:  # documents prepared before they were added differ
            self.unique_identifiers["specials"] = f"{self.special_prefix}{self.special_suffix}"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, specials: bool = False) -> List[int]:
        """The text's ids; with `specials`, as `tokenizer(text)` gives them ([Note: the tokenizer's
        own special tokens])."""
        return self._tok.encode(text, add_special_tokens=specials).ids

    def encode_batch(self, texts: List[str], specials: bool = False) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=specials)]

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str) -> BPETokenizer:
    """Train a byte-level BPE of `vocab_size` on `texts`; write it to `out_path` atomically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    from framework.fileio import create_temporary

    tmp = f"{out_path}.tmp-{os.getpid()}"
    with create_temporary(tmp) as handle:  # never through a planted link (tok.save follows one)
        handle.write(tok.to_str(pretty=True))
    os.replace(tmp, out_path)
    return BPETokenizer(out_path)


class SFTTokenizer:
    """What fine-tuning needs from a tokenizer: encode, the end-of-document id, and a chat
    template when the tokenizer has one. Wraps our `BPETokenizer` or a Hugging Face tokenizer."""

    def __init__(self, tokenizer, eod: int, hf=None):
        self.tokenizer, self.eod, self.hf = tokenizer, eod, hf
        if hf is not None:
            self.special_prefix, self.special_suffix = special_ends(self.encode, lambda t: self.encode(t, True))
        else:  # a tokenizer of ours, or one that knows no post-processor (none added)
            self.special_prefix = list(getattr(tokenizer, "special_prefix", []))
            self.special_suffix = list(getattr(tokenizer, "special_suffix", []))

    @property
    def path(self):
        """The tokenizer.json behind it (an export copies it), or None."""
        if self.hf is not None:
            found = os.path.join(getattr(self.hf, "name_or_path", ""), "tokenizer.json")
            return found if os.path.isfile(found) else None
        return getattr(self.tokenizer, "path", None)

    @property
    def vocab_size(self) -> int:
        return len(self.hf) if self.hf is not None else self.tokenizer.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self.hf is not None and getattr(self.hf, "chat_template", None) is not None

    def encode(self, text: str, specials: bool = False) -> list:
        """The text's ids; with `specials`, those `tokenizer(text)` gives ([Note: the tokenizer's own
        special tokens])."""
        if self.hf is not None:
            return list(self.hf(text, add_special_tokens=specials)["input_ids"])
        if specials and (self.special_prefix or self.special_suffix):
            return list(self.tokenizer.encode(text, specials=True))
        return list(self.tokenizer.encode(text))

    def encode_batch(self, texts: list, specials: bool = False) -> list:
        if self.hf is not None:
            return [list(ids) for ids in self.hf(list(texts), add_special_tokens=specials)["input_ids"]]
        if specials and (self.special_prefix or self.special_suffix):
            return [list(ids) for ids in self.tokenizer.encode_batch(list(texts), specials=True)]
        return self.tokenizer.encode_batch(list(texts))

    @functools.cached_property
    def eos_text(self):
        """The end-of-document token as text (what TRL appends to a reply), or None when no text
        encodes to exactly that id (then the id is appended after the text's)."""
        if self.hf is not None:
            text = self.hf.convert_ids_to_tokens(self.eod)
        else:
            to_token = getattr(getattr(self.tokenizer, "_tok", None), "id_to_token", None)
            text = to_token(self.eod) if to_token is not None else None
        return text if isinstance(text, str) and text and self.encode(text) == [self.eod] else None

    def decode(self, ids) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids))
        return self.tokenizer.decode(list(ids))

    def chat_ids(self, messages: list, add_generation_prompt: bool = False) -> list:
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # a BatchEncoding
            out = out["input_ids"]
        return list(out)


def load_tokenizer(path: str, setting: str = "finetune.tokenizer") -> SFTTokenizer:
    """A tokenizer.json file (ours), or a directory holding a Hugging Face tokenizer (its chat
    template included when it has one)."""
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise UserInputError(
                f"{setting}={path}: the directory holds no tokenizer.json or "
                "tokenizer_config.json; give a tokenizer file or directory"
            )
        hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        eod = hf.eos_token_id if hf.eos_token_id is not None else len(hf) - 1
        return SFTTokenizer(None, eod, hf=hf)
    tok = BPETokenizer(path)
    return SFTTokenizer(tok, tok.eod)


# [Note: the data's tokenizer against the model's]
# A Hugging Face model (model=hf model.path=<dir>) was trained on its own tokenizer: id 17 is one
# token to it. Data prepared with another tokenizer gives it ids it reads as other tokens (a
# foreign BPE of the same size trains without a word, on the wrong table) or ids past its
# embedding (a bigger one: an IndexError at the first batch). So before any rank starts
# (`data_tokenizer_problem`, which framework/preflight.py runs for every stage but fine-tuning), the
# tokenizer the data was prepared with (<prefix>.tokenizer.json, which data preparation writes for
# every dataset, or data.tokenizer) is compared with the one model.path holds, by their token
# tables (token -> id, added tokens included), and a difference is refused in one line naming both
# files. data=stdlib, the embedded corpus, is prepared with the model's tokenizer.json (when it has
# one and data.tokenizer is empty), so it agrees by construction. A model directory without a
# tokenizer has no table to compare: the data's ids are held to its vocabulary when the data is
# loaded (framework/data/indexed.py).


def model_tokenizer(model_path: str) -> str:
    """The tokenizer a Hugging Face model directory (model.path) holds: its tokenizer.json, else the
    directory itself when it has a tokenizer_config.json (a tokenizer transformers reads from other
    files), else ""."""
    if not model_path or not os.path.isdir(model_path):
        return ""
    found = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(found):
        return found
    return model_path if os.path.isfile(os.path.join(model_path, "tokenizer_config.json")) else ""


def token_table(path: str) -> dict:
    """token -> id of a tokenizer.json (or of a directory's tokenizer, through transformers),
    added tokens included."""
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        return dict(AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab())
    from tokenizers import Tokenizer

    return dict(Tokenizer.from_file(path).get_vocab(with_added_tokens=True))


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def table_difference(ours: str, theirs: str) -> str:
    """ "" when the tokenizers `ours` and `theirs` give every token the same id; else what differs,
    in a few words. A file that is not a tokenizer is a UserInputError naming it."""
    if os.path.isfile(ours) and os.path.isfile(theirs) and _digest(ours) == _digest(theirs):
        return ""
    tables = []
    for path in (ours, theirs):
        try:
            tables.append(token_table(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers' and transformers' parse errors vary
            raise UserInputError(
                f"{path} is not a tokenizer this job can read ({type(exc).__name__}); give a tokenizer.json"
            ) from None
    a, b = tables
    if a == b:
        return ""
    by_id_a, by_id_b = ({i: t for t, i in table.items()} for table in (a, b))
    first = min(i for i in set(by_id_a) | set(by_id_b) if by_id_a.get(i) != by_id_b.get(i))
    there, here = by_id_a.get(first), by_id_b.get(first)
    return f"{len(a)} vs {len(b)} ids; id {first} is {there!r} there, {here!r} in the model's"


def data_tokenizer_problem(data, model_path: str) -> str:
    """The job's data (a DataConfig) against model.path's tokenizer, before any rank starts (see
    [Note: the data's tokenizer against the model's]): one line naming both files, or ""."""
    theirs = model_tokenizer(model_path)
    name = getattr(data.name, "value", data.name)
    if not theirs or name not in ("indexed", "stdlib", "hf"):
        return ""
    if theirs.endswith(".json"):
        fix = f"prepare the data with data.tokenizer={theirs} (stage=data_preparation)"
    else:
        fix = "prepare the data with the model's tokenizer (saved as a tokenizer.json)"
    if not theirs.endswith(".json") and name == "stdlib" and not data.tokenizer:
        return (
            f"data=stdlib is prepared with model.path's tokenizer, but {theirs} has no tokenizer.json; write "
            "one (AutoTokenizer.from_pretrained(dir).save_pretrained(dir)), or give data.tokenizer=<a tokenizer.json>"
        )
    readable = os.path.isfile(data.tokenizer) or (name == "hf" and os.path.isdir(data.tokenizer))
    given = [("data.tokenizer", data.tokenizer)] if data.tokenizer and readable else []
    recorded = [(p, p + ".tokenizer.json") for p in data.paths if os.path.isfile(p + ".tokenizer.json")]
    for field, ours in given + (recorded if name == "indexed" else []):
        try:
            difference = table_difference(ours, theirs)
        except UserInputError as exc:
            return f"{field}: {exc}" if field == "data.tokenizer" else f"data.paths: {exc}"
        if not difference:
            continue
        if field == "data.tokenizer":
            stdlib = " (data=stdlib is then prepared with the model's)" if name == "stdlib" else ""
            return (
                f"data.tokenizer={ours}: its token table is not model.path's {theirs} ({difference}): the model "
                f"would read the data's ids as other tokens; leave data.tokenizer empty{stdlib} or give the model's"
            )
        return (
            f"data.paths: {field} was prepared with the tokenizer {ours}, whose token table is not "
            f"model.path's {theirs} ({difference}): the model would read its ids as other tokens; {fix}"
        )
    return ""
