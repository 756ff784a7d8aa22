"""A model family kept outside the framework, as a user's own would be: this module and
`tests/models/toy_family/conf/model/toy_mlp.yaml` are all of it (the YAML names this module in `model.family_module`).

A tiny causal language model: token embedding, `depth` residual MLP blocks (the sharding units),
a head. Its arguments are its own typed dataclass (`model.args`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.models.registry import ModelFamily, register_family


@dataclass(frozen=True)
class ToyArgs:
    vocab_size: int = 64
    width: int = 32
    depth: int = 2


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.relu(self.up(h)))


class ToyLM(nn.Module):
    def __init__(self, vocab: int, args: ToyArgs) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, args.width)
        self.blocks = nn.ModuleList(Block(args.width) for _ in range(args.depth))
        self.head = nn.Linear(args.width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _build(cfg, device="cpu") -> ToyLM:
    with torch.device(device):
        args = FAMILY.args_of(cfg)
        return ToyLM(args.vocab_size, args)


FAMILY = register_family(
    ModelFamily(
        names=("toy_mlp",),
        build=_build,
        blocks=lambda m: list(m.blocks),
        args_type=ToyArgs,
        vocab_size=lambda cfg: FAMILY.args_of(cfg).vocab_size,
    )
)
