"""Model definitions: plain nn.Modules. One registry maps a model family to its builder and its
tensor-parallel plan; the config's `model.name` presets all belong to the Llama family."""
from framework.models.llama import Transformer, TransformerBlock, build_llama  # noqa: F401


def build_model(cfg, device="cpu"):
    return build_llama(cfg, device)
