"""The Hugging Face family's own arguments (`model.args`) and checks; no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

NAMES = ("hf",)


@dataclass
class HFArgs:
    # the longest data.seq_len accepted; the model's own position limit still applies
    max_seq_len: int = 1024


def problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1) -> List[str]:
    from framework.models.args import parse_args

    a = parse_args(HFArgs, cfg)
    if cp > 1:
        return [
            f"parallelism.cp={cp} with model=hf: a Hugging Face model's attention does not split its "
            "sequences yet (our Llama family's does); set parallelism.cp=1"
        ]
    if ep > 1:
        return [
            f"parallelism.ep={ep} with model=hf: Hugging Face mixture-of-experts blocks are sharded whole "
            "(one unit per block), not split by expert yet; set parallelism.ep=1"
        ]
    if seq_len > a.max_seq_len:
        return [
            f"data.seq_len={seq_len} is longer than model.args.max_seq_len={a.max_seq_len} of model=hf; "
            "lower data.seq_len or raise model.args.max_seq_len"
        ]
    return []
