"""A Hugging Face model as the planner sees it: built on the meta device (no memory, no weights
read), its `_no_split_modules` blocks as units and everything else as the root, as
`framework/distributed/parallelize.py` shards it. The widths for the activation and FLOP estimates
are read from the transformers config under its standard names (`hidden_size`,
`num_attention_heads`, `intermediate_size`; transformers maps each family's own names onto them);
where a config has no intermediate size (GPT-2's `n_inner: null`) it is 4 x hidden, as the model
builds it. The activation estimate is the Llama block's formula at those widths: an approximation
for other block shapes (docs/planner.md)."""

from __future__ import annotations

from dataclasses import replace

from framework.models.hf.args import CONTEXT_PARALLEL_TYPES
from framework.models.shapes import ModelShape, Tensor, Unit


def plan_shape(cfg, vocab_size: int) -> ModelShape:
    from framework.models.hf.model import blocks, build_hf, hf_config
    from framework.param_roles import hidden_matrix_names

    model = build_hf(cfg, "meta")  # no memory, no weights read
    seen: set = set()
    full_name = {id(p): n for n, p in model.named_parameters()}
    muon = hidden_matrix_names(model)  # optimizer=muon's matrices, as the optimizer builder takes them
    from framework.models.hf.moe import is_hf_experts

    # stacked experts (split by parallelism.ep: [Note: Hugging Face experts by expert]): their count
    stacked = {id(p): m.num_experts for m in model.modules() if is_hf_experts(m) for p in m.parameters(recurse=False)}

    def tensors(module) -> tuple:
        out = []
        for p in module.parameters():  # a tied tensor once, where it is met first; model-level names
            if id(p) not in seen:
                seen.add(id(p))
                name = full_name[id(p)]
                row = p[0].numel() if p.dim() >= 2 else 1
                matrix = tuple(p.shape[-2:]) if p.dim() >= 2 else ()  # a replace() keeps it whole over tp
                experts = stacked.get(id(p), 0)
                out.append(Tensor(name, p.numel(), False, row=row, muon=name in muon, matrix=matrix, experts=experts))
        return tuple(out)

    per_unit = [(f"block.{i}", tensors(b)) for i, b in enumerate(blocks(model))]
    root_tensors = tensors(model)  # what no block took: embeddings, final norms, heads
    plan = _plan_or_none(model)

    def layout(shape: ModelShape, tp: int) -> list:
        if tp == 1:
            return [Unit("root", root_tensors)] + [Unit(name, ts) for name, ts in per_unit]
        if plan is None:
            raise AssertionError("model=hf without a tensor-parallel plan is planned at tp=1 only")
        split = [Unit(name, tuple(_split(t, plan, tp, model) for t in ts)) for name, ts in per_unit]
        return [Unit("root", tuple(_split(t, plan, tp, model) for t in root_tensors))] + split

    config = hf_config(cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dim = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    ffn = getattr(text, "intermediate_size", None) or getattr(text, "d_ff", None) or getattr(text, "n_inner", None)
    emb = model.get_input_embeddings()
    # Mixture of experts: the routed experts a token does not use count as inactive (FLOPs), and
    # n_experts / top_k size expert parallelism's all-to-alls (framework/planner/estimate.py)
    n_experts = max(stacked.values(), default=0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0) if n_experts else 0
    expert_numel = sum(t.numel for _, ts in per_unit for t in ts if t.experts)
    return ModelShape(
        vocab_size=int(getattr(text, "vocab_size", vocab_size) or vocab_size),
        dim=dim,
        n_layers=len(per_unit),
        n_heads=heads,
        n_kv_heads=int(getattr(text, "num_key_value_heads", heads) or heads),
        ffn_dim=int(ffn or 4 * dim),
        layout=layout,
        embedding_numel=emb.weight.numel() if emb is not None else 0,
        tensor_parallel=plan is not None,
        n_experts=n_experts,
        top_k=top_k,
        inactive_params=expert_numel * (n_experts - top_k) // n_experts if n_experts else 0,
        pipeline=_pipeline_ok(model),
        context_parallel=getattr(model.config, "model_type", "") in CONTEXT_PARALLEL_TYPES,
        pipeline_experts=bool(n_experts) and _pipeline_ok(model),  # experts inside its stages at ep > 1
    )


def _pipeline_ok(model) -> bool:
    """What framework/models/hf/pipeline.py's `check_pipeline` says of `model` (True: it cuts it)."""
    from framework.errors import UserInputError
    from framework.models.hf.pipeline import check_pipeline

    try:
        check_pipeline(model, 2)
    except UserInputError:
        return False
    return True


def _plan_or_none(model):
    """{module name: style name} of the model's tensor-parallel plan, or None when it has none."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from framework.errors import UserInputError
    from framework.models.hf.parallelize import hf_tp_plan

    try:
        plan = hf_tp_plan(model, False)
    except UserInputError:
        return None
    return {name: "colwise" if isinstance(style, ColwiseParallel) else "rowwise" for name, style in plan.items()}


def _split(t: Tensor, plan: dict, tp: int, model) -> Tensor:
    """`t` (a full parameter name) as tp rank 0 holds it: colwise splits dim 0 of weight and bias,
    rowwise dim 1 of the weight (an embedding table: its rows)."""
    module_name, _, leaf = t.name.rpartition(".")
    style = plan.get(module_name)
    if style is None:
        return t
    p = model.get_parameter(t.name)
    if p.dim() == 1:
        return replace(t, numel=-(-p.numel() // tp), tp_split=True) if style == "colwise" else t
    rows, cols = p.shape[0], p.numel() // p.shape[0]
    is_embedding = isinstance(model.get_submodule(module_name), __import__("torch").nn.Embedding)
    if style == "colwise" or is_embedding:
        return replace(t, numel=-(-rows // tp) * cols, tp_split=True, row=cols)
    return replace(t, numel=rows * -(-cols // tp), tp_split=True, row=-(-cols // tp))
