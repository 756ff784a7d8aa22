"""The Hugging Face family (`model=hf`) as the torch-free parts of the framework see it: its
name, the checks of its one argument against the job, the planner's shapes (which build the
model on the meta device), and where its record is (torch and transformers)."""

from framework.models.hf.args import NAMES, problems  # noqa: F401 - the spec's fields
from framework.models.hf.shapes import plan_shape  # noqa: F401


def record():
    """The family's record (`framework/models/hf/family.py`; imports torch)."""
    from framework.models.hf.family import FAMILY

    return FAMILY
