from framework.models.llama.model import Transformer, TransformerBlock, build_llama  # noqa: F401
