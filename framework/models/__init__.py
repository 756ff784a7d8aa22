"""Model definitions (plain nn.Modules) and the registry that describes each family to the rest of
the framework (`framework/models/registry.py`). Each family registers itself when imported here:
one explicit import line per family."""

from framework.models import cnn, hf, llama  # noqa: F401  (each registers its family)
from framework.models.llama import Transformer, TransformerBlock, build_llama  # noqa: F401
from framework.models.registry import ModelFamily, family_of, register_family  # noqa: F401
from framework.models.tasks import Task, get_task, register_task  # noqa: F401


def build_model(cfg, device="cpu"):
    """The plain model `model.name` names, on `device` (meta: no memory)."""
    return family_of(cfg).build(cfg, device)
