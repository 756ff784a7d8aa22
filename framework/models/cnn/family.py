"""The record of the digits recipe's image classifier (`experiment=digits_cnn`).

Its config reuses the generic model fields: `model.dim` is the first convolution's channels (the
second has twice as many), `model.ffn_dim` the classifier's hidden size, `model.vocab_size` the
number of classes (set from the data: 10 digits).
"""

from framework.models.cnn.model import DigitsCNN
from framework.models.registry import ModelFamily, register_family
from framework.models.tasks import get_task


def build_cnn(cfg, device="cpu") -> DigitsCNN:
    import torch

    with torch.device(device):
        return DigitsCNN(channels=cfg.dim, hidden=cfg.ffn_dim, num_classes=cfg.vocab_size)


FAMILY = register_family(
    ModelFamily(
        names=("digits_cnn",),
        build=build_cnn,
        blocks=lambda model: model.blocks(),
        task=lambda cfg: get_task("image_classification"),
        init_weights=lambda model, seed: model.init_weights(seed),
        flops_per_token=lambda model, seq_len: model.flops_per_token(),
    )
)
