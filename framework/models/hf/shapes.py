"""A Hugging Face model as the planner sees it: built on the meta device (no memory, no weights
read), its `_no_split_modules` blocks as units and everything else as the root, as
`framework/distributed/parallelize.py` shards it. The widths for the activation and FLOP estimates
are read from the transformers config under its standard names (`hidden_size`,
`num_attention_heads`, `intermediate_size`; transformers maps each family's own names onto them);
where a config has no intermediate size (GPT-2's `n_inner: null`) it is 4 x hidden, as the model
builds it. The activation estimate is the Llama block's formula at those widths: an approximation
for other block shapes (docs/planner.md)."""

from __future__ import annotations

from framework.models.shapes import ModelShape, Tensor, Unit

NAMES = ("hf",)


def plan_shape(cfg, vocab_size: int) -> ModelShape:
    from framework.models.hf.model import blocks, build_hf, hf_config

    model = build_hf(cfg, "meta")  # no memory, no weights read
    seen: set = set()

    def tensors(module) -> tuple:
        out = []
        for name, p in module.named_parameters():  # a tied tensor once, where it is met first
            if id(p) not in seen:
                seen.add(id(p))
                out.append(Tensor(name, p.numel(), False))
        return tuple(out)

    block_units = [Unit(f"block.{i}", tensors(b)) for i, b in enumerate(blocks(model))]
    root = Unit("root", tensors(model))  # what no block took: embeddings, final norms, heads
    laid_out = [root] + block_units

    def layout(shape: ModelShape, tp: int) -> list:
        assert tp == 1, "model=hf has no tensor-parallel plan"
        return laid_out

    config = hf_config(cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dim = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    ffn = getattr(text, "intermediate_size", None) or getattr(text, "d_ff", None) or getattr(text, "n_inner", None)
    emb = model.get_input_embeddings()
    return ModelShape(
        vocab_size=int(getattr(text, "vocab_size", vocab_size) or vocab_size),
        dim=dim,
        n_layers=len(block_units),
        n_heads=heads,
        n_kv_heads=int(getattr(text, "num_key_value_heads", heads) or heads),
        ffn_dim=int(ffn or 4 * dim),
        layout=layout,
        embedding_numel=emb.weight.numel() if emb is not None else 0,
        tensor_parallel=False,
    )
