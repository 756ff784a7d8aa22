"""The digits recipe's image classifier as the torch-free parts of the framework see it: its
name and where its record is. It has no checks against the job beyond the common ones and no
planner shapes (`stage=plan` refuses it in one line)."""

from framework.models.cnn.args import NAMES, check  # noqa: F401 - the spec's fields


def record():
    """The family's record (`framework/models/cnn/family.py`; imports torch)."""
    from framework.models.cnn.family import FAMILY

    return FAMILY
