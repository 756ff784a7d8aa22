"""The record of the digits recipe's image classifier (`experiment=digits_cnn`).

Its arguments are its own (`model.args`, `DigitsCNNArgs`), not the language models' fields.
"""

from dataclasses import dataclass

from framework.models.cnn.model import DigitsCNN
from framework.models.registry import ModelFamily, register_family
from framework.models.tasks import get_task


@dataclass(frozen=True)
class DigitsCNNArgs:
    channels: int = 32  # of the first convolution (the second has twice as many)
    hidden: int = 128  # the classifier's hidden size
    num_classes: int = 10  # the ten digits
    dropout: float = 0.1


def build_cnn(cfg, device="cpu") -> DigitsCNN:
    import torch

    a = FAMILY.args_of(cfg)
    with torch.device(device):
        return DigitsCNN(channels=a.channels, hidden=a.hidden, num_classes=a.num_classes, dropout=a.dropout)


FAMILY = register_family(
    ModelFamily(
        names=("digits_cnn",),
        build=build_cnn,
        blocks=lambda model: model.blocks(),
        task=lambda cfg: get_task("image_classification"),
        init_weights=lambda model, seed: model.init_weights(seed),
        flops_per_token=lambda model, seq_len: model.flops_per_token(),
        args_type=DigitsCNNArgs,
        vocab_size=lambda cfg: FAMILY.args_of(cfg).num_classes,
    )
)
