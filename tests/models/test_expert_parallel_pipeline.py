"""Experts inside pipeline stages (ep x pp, DeepSeek-V3's layout): `model=moe_debug` on 4 gloo
ranks, 1F1B, trains as one process does on the same global batch (losses, grad norms, every weight
after the run), at ep=2 and at ep=1; and its checkpoint at ep=2 x pp=2 resumes at ep=1 and ep=4.

Every micro-batch holds one sample on every layout (one process: 4 micro-batches of 1; the
pipelines: 2 data-parallel ranks x 2 microbatches of 1), so the per-micro-batch load-balancing
loss sums the same terms everywhere ([Note: the load-balancing loss in a pipeline],
framework/models/llama/pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_metrics
from models.test_expert_parallel_dims import MOE, TOL, _assert_same, _run

PIPE = [
    *MOE,
    "model.args.tie_embeddings=false",  # the embedding and the head live on different stages
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=4",
    "trainer.eval_interval=4",  # a validation at the end: its loss holds the stages' aux losses too
]
STAGES = ["cluster.nproc_per_node=4", "parallelism.pp=2", "parallelism.dp_shard=2", "parallelism.pp_schedule=1f1b"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, stdlib_cache) -> Path:
    root = tmp_path_factory.mktemp("moe_pp_one")
    return _run(root, "one", [*PIPE, "cluster.nproc_per_node=1"], stdlib_cache)


@pytest.fixture(scope="module")
def ep2_pp2(tmp_path_factory, stdlib_cache) -> Path:
    """ep=2 x pp=2 (dp_shard=2): each stage's experts split over its 2 data-parallel ranks; a
    checkpoint at step 2 of 4."""
    root = tmp_path_factory.mktemp("moe_pp_ep2")
    return _run(root, "ep2_pp2", [*PIPE, *STAGES, "parallelism.ep=2", "checkpoint.interval=2"], stdlib_cache)


def test_ep_with_pipeline_equals_one_process(one_process, ep2_pp2):
    """Each stage's aux loss reaches the backward (a missing one changes the router's gradient and
    so the grad norm and the weights) and joins the reported loss."""
    _assert_same(ep2_pp2, one_process)


def test_the_pipelines_validation_loss_holds_every_stages_aux_loss(one_process, ep2_pp2):
    def val(run):
        return [r["val_loss"] for r in read_metrics(run) if "val_loss" in r]

    assert len(val(one_process)) == 1 and val(ep2_pp2) == pytest.approx(val(one_process), abs=TOL)


def test_the_pipelines_router_statistics_are_one_process(one_process, ep2_pp2):
    """Each stage's routers count their own blocks' slots and the record sums them over the ranks:
    metrics.jsonl holds the same router keys as one process's, with the same loads (the same
    samples routed by weights equal within 1e-5: the same choices, counts exact)."""

    def stats(run):
        return [{k: v for k, v in r.items() if k.startswith("moe_")} for r in read_metrics(run) if "loss" in r]

    one, pipe = stats(one_process), stats(ep2_pp2)
    assert len(one) == 4 and all(
        sorted(r) == ["moe_load_l0", "moe_load_l1", "moe_max_mean_l0", "moe_max_mean_l1"] for r in one
    )
    assert [sorted(r) for r in pipe] == [sorted(r) for r in one]
    for mine, theirs in zip(pipe, one):
        assert mine["moe_load_l0"] == theirs["moe_load_l0"] and mine["moe_load_l1"] == theirs["moe_load_l1"]
        assert mine["moe_max_mean_l1"] == pytest.approx(theirs["moe_max_mean_l1"])


def test_experts_in_a_pipeline_at_ep1_equal_one_process(one_process, tmp_path, stdlib_cache):
    _assert_same(_run(tmp_path, "ep1_pp2", [*PIPE, *STAGES], stdlib_cache), one_process)


@pytest.mark.parametrize("ep", [1, 4])
def test_ep2_pp2_checkpoint_resumes_at_another_expert_degree(ep2_pp2, tmp_path, stdlib_cache, ep):
    """The step-2 checkpoint of ep=2 x pp=2, resumed without a pipeline on 4 ranks (dp_shard=4)
    with every rank holding all experts (ep=1) or one each (ep=4): steps 3-4 log the uninterrupted
    run's losses (TOL: the same sums in another order)."""
    resume = f"checkpoint.resume={ep2_pp2 / 'checkpoints' / 'step_00000002'}"
    run = _run(tmp_path, f"ep{ep}", [*PIPE, "cluster.nproc_per_node=4", f"parallelism.ep={ep}", resume], stdlib_cache)
    want = {r["step"]: r["loss"] for r in read_metrics(ep2_pp2) if "loss" in r}
    got = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}
    assert sorted(got) == [3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=TOL), step
