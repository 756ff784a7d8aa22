"""Our Llama family's record: the model, its tensor-parallel plan, its Hugging Face adapter."""

from framework.models.llama.adapter import LlamaAdapter
from framework.models.llama.args import NAMES as PRESETS
from framework.models.llama.args import LlamaArgs, check_rope_scaling, llama_args, with_vocab_size
from framework.models.llama.model import Transformer, TransformerBlock, build_llama  # noqa: F401
from framework.models.llama.parallelize import tp_plan
from framework.models.llama.pipeline import pipeline_stage
from framework.models.record import ModelFamily


def _build(cfg, device="cpu") -> Transformer:
    check_rope_scaling(cfg)
    return build_llama(cfg, device)


def _init_weights(model: Transformer, seed) -> None:
    model.init_weights(seed=seed)


FAMILY = ModelFamily(
    names=PRESETS,
    build=_build,
    check=check_rope_scaling,
    blocks=lambda model: list(model.layers),
    init_weights=_init_weights,
    tp_plan=tp_plan,
    pipeline_stage=pipeline_stage,
    adapter=lambda cfg: LlamaAdapter(tied=llama_args(cfg).tie_embeddings),
    embedding_name="tok_embeddings.weight",
    num_params=lambda model: model.num_params(),
    flops_per_token=lambda model, seq_len: model.flops_per_token(seq_len),
    args_type=LlamaArgs,
    vocab_size=lambda cfg: llama_args(cfg).vocab_size,
    with_vocab_size=with_vocab_size,
)
