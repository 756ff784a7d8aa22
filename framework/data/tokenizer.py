"""A byte-level BPE tokenizer (Hugging Face `tokenizers`), trained locally or read from a
tokenizer.json, with what our trainer needs (encode/decode) and what megatron-core's datasets
need (vocab_size, eod, unique_identifiers)."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Iterable, List

from framework.errors import UserInputError

EOD = "<|endoftext|>"  # ends every document in the prepared datasets


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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

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
    tmp = f"{out_path}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, out_path)
    return BPETokenizer(out_path)
