"""Our Llama family as the torch-free parts of the framework see it: the `model.name` values it
builds (its presets), the checks of its arguments against the job, the planner's shapes, and
where its record is (torch: the model, its tensor-parallel plan, its Hugging Face adapter)."""

from framework.models.llama.args import NAMES, check, problems  # noqa: F401 - the spec's fields
from framework.models.llama.shapes import plan_shape  # noqa: F401


def record():
    """The family's record (`framework/models/llama/family.py`; imports torch)."""
    from framework.models.llama.family import FAMILY

    return FAMILY
