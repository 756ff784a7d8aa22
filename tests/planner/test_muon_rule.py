"""The planner counts Muon's state and whole-matrix traffic on exactly the matrices the optimizer
builder gives Muon (framework/param_roles.py, [Note: what weight decay leaves alone]), for every
model family the planner knows: our Llama presets (dense and mixture-of-experts) and each of the
15 Hugging Face families. Before the rule was shared the planner took "every 2-D tensor of a
block" and missed BERT's pooler (outside the blocks), counted T5's relative-attention table (an
embedding inside a block) and our Llama's position-free root alike."""

from __future__ import annotations

import pytest

from tests.hf.test_hf_families import FAMILIES

OUR_PRESETS = ("debug", "small", "moe_debug", "llama_125m")


def _planner_muon_names(shape, model) -> set:
    """Full parameter names of the tensors the planner's memory and traffic count as Muon's."""
    from framework.planner.estimate import UnitLayout, muon_tensors

    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out = set()
    for unit in shape.layout(shape, 1):
        lay = UnitLayout(unit, unit.numel, unit.numel, 1, unit.numel)
        for t, muon in zip(unit.tensors, muon_tensors(lay)):
            full = t.name if t.name in names else f"{unit.name}.{t.name}"  # our Llama's block tensors
            assert full in names, (unit.name, t.name)
            if muon:
                out.add(full)
    return out


def _builder_muon_names(model) -> set:
    """hidden_matrix_names, one name per tensor (the name a tied tensor is met first by)."""
    from framework.optim import hidden_matrix_names

    hidden = hidden_matrix_names(model)
    return {n for n, _ in model.named_parameters() if n in hidden}


def _same(shape, model, label):
    planner, builder = _planner_muon_names(shape, model), _builder_muon_names(model)
    assert planner == builder, (
        label,
        "planner only:",
        sorted(planner - builder),
        "builder only:",
        sorted(builder - planner),
    )
    assert builder, label


@pytest.mark.parametrize("label", sorted(FAMILIES))
def test_planner_and_builder_agree_on_hugging_face_families(label):
    from framework.config.schema import ModelConfig
    from framework.models import family_of
    from framework.models.families import plan_shape

    model_type, config, task = FAMILIES[label]
    cfg = ModelConfig(name="hf", config=dict(config, model_type=model_type), task=task, args={"max_seq_len": 64})
    _same(plan_shape(cfg, 0), family_of(cfg).build(cfg, "meta"), label)


@pytest.mark.parametrize("preset", OUR_PRESETS)
def test_planner_and_builder_agree_on_our_llama(preset):
    from framework.config import compose_config, to_config
    from framework.models import family_of
    from framework.models.families import plan_shape

    cfg = to_config(compose_config([f"model={preset}"])).model
    family = family_of(cfg)
    cfg = family.with_vocab_size(cfg, 256)
    _same(plan_shape(cfg, 256), family.build(cfg, "meta"), preset)


@pytest.mark.parametrize("nodes", [1, 8])
def test_muon_work_divides_for_llama_3_1_8b(nodes):
    """stage=plan for Llama 3.1 8B under optimizer=muon on 8 and 64 ranks: its 224 block matrices'
    Newton-Schulz work per rank (plan.json's `muon`), the busiest at most 1.15x the mean
    ([Note: balancing whole-matrix owners]). Owners fixed by layout alone gave 2.11x on 8 ranks
    and 16.9x on 64 (a block's matrices on the few ranks holding it)."""
    from framework.config import compose_config, to_config
    from framework.planner.plan import make_plan, plan_json

    overrides = ["model=llama3_1_8b", "optimizer=muon", f"cluster.nodes={nodes}", "cluster.nproc_per_node=8"]
    cfg = to_config(compose_config(overrides + ["cluster.gpus_per_node=8"]))
    muon = plan_json(make_plan(cfg))["muon"]
    work = muon["work_flops_per_rank"]
    assert len(work) == 8 * nodes

    def ns(m: int, n: int) -> int:  # 5 quintic steps on the wide orientation m x n (m <= n)
        return 5 * (4 * m * m * n + 2 * m**3)

    d, kv, f = 4096, 1024, 14336  # Llama 3.1 8B: wq, wo d x d; wk, wv kv x d; w1, w3, w2 f x d
    assert sum(work) == 32 * (2 * ns(d, d) + 2 * ns(kv, d) + 3 * ns(d, f))  # each matrix once
    assert muon["work_max_over_ideal"] == pytest.approx(max(work) * len(work) / sum(work))
    assert muon["work_max_over_ideal"] <= 1.15, muon["work_max_over_ideal"]
