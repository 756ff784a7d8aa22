"""The record of the digits recipe's image classifier (`experiment=digits_cnn`).

Its arguments are its own (`model.args`, `DigitsCNNArgs` in args.py), not the language models' fields.
"""

from framework.models.cnn.args import NAMES, DigitsCNNArgs
from framework.models.cnn.model import DigitsCNN
from framework.models.record import ModelFamily
from framework.models.tasks import get_task


def build_cnn(cfg, device="cpu") -> DigitsCNN:
    import torch

    a = FAMILY.args_of(cfg)
    with torch.device(device):
        return DigitsCNN(channels=a.channels, hidden=a.hidden, num_classes=a.num_classes, dropout=a.dropout)


FAMILY = ModelFamily(
    names=NAMES,
    build=build_cnn,
    blocks=lambda model: model.blocks(),
    task=lambda cfg: get_task("image_classification"),
    init_weights=lambda model, seed: model.init_weights(seed),
    flops_per_token=lambda model, seq_len: model.flops_per_token(),
    args_type=DigitsCNNArgs,
    vocab_size=lambda cfg: FAMILY.args_of(cfg).num_classes,
)
