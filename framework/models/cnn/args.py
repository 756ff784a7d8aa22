"""The digits classifier's names and its own arguments (`model.args`); no torch."""

from dataclasses import dataclass

NAMES = ("digits_cnn",)


@dataclass(frozen=True)
class DigitsCNNArgs:
    channels: int = 32  # of the first convolution (the second has twice as many)
    hidden: int = 128  # the classifier's hidden size
    num_classes: int = 10  # the ten digits
    dropout: float = 0.1


def check(cfg) -> None:
    """`model.args` parsed (an unknown or mistyped field refused in one line), without torch."""
    from framework.models.args import parse_args

    parse_args(DigitsCNNArgs, cfg)
