"""Load balancing independent of the layout, inside pipeline stages ([Note: routers in a pipeline],
framework/distributed/pipeline_routing.py): `model=moe_debug` (2 blocks: one per stage at pp=2)
with the global-batch load-balancing loss and DeepSeek-V3's aux-loss-free bias together trains as
one process does (losses, grad norms and every weight after 5 steps, the checkpointed expert
biases among them) at pp=2, at pp=2 x ep=2 (dp_shard=2) and at ep=2 without a pipeline.

The reference is one process with the whole global batch (4 samples) as one micro-batch, where
the global-batch loss is the micro-batch's by definition; the pipelines run 4 or 2 microbatches
of 1 sample, so without the routing pass ahead their balancing loss (and gradient) is another
(aux_loss_coef=0.1 makes that ~1e-3 apart), and a bias summed over the wrong ranks (the world,
where the other pp index holds the other block) moves by other loads (steps of 0.005)."""

from __future__ import annotations

from pathlib import Path

import pytest
from models.test_expert_parallel_dims import MOE, _assert_same, _run

BALANCED = [
    *MOE,
    "trainer.max_steps=5",
    "model.args.tie_embeddings=false",  # the embedding and the head live on different stages
    "trainer.global_batch_size=4",
    "model.args.aux_loss_scope=global_batch",
    "model.args.aux_loss_coef=0.1",
    "model.args.bias_update_rate=0.005",
]
PP2 = ["parallelism.pp=2", "parallelism.pp_schedule=1f1b", "trainer.micro_batch_size=1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, stdlib_cache) -> Path:
    root = tmp_path_factory.mktemp("moe_balance_pp_one")
    return _run(root, "one", [*BALANCED, "cluster.nproc_per_node=1", "trainer.micro_batch_size=4"], stdlib_cache)


def test_pp2_balances_the_global_batch_and_moves_the_bias_as_one_process(one_process, tmp_path, stdlib_cache):
    """pp=2 on 2 ranks, 4 microbatches of 1: each stage routes the step ahead through the
    schedule's forward-only pass, and its router's loads (the bias's too) are its own rank's."""
    _assert_same(_run(tmp_path, "pp2", [*BALANCED, *PP2, "cluster.nproc_per_node=2"], stdlib_cache), one_process)


def test_pp2_ep2_sums_each_routers_loads_over_its_stages_ranks(one_process, tmp_path, stdlib_cache):
    """pp=2 x ep=2 (dp_shard=2) on 4 ranks: each stage's router loads summed over the 2 ranks of
    its pp index, so both copies of a router move their bias alike, as one process's; and ep=2
    without a pipeline (micro-batches of 1) gives the same run too."""
    stages = ["cluster.nproc_per_node=4", "parallelism.dp_shard=2", "parallelism.ep=2"]
    _assert_same(_run(tmp_path, "pp2_ep2", [*BALANCED, *PP2, *stages], stdlib_cache), one_process)
    ep2 = ["cluster.nproc_per_node=2", "parallelism.ep=2", "trainer.micro_batch_size=1"]
    _assert_same(_run(tmp_path, "ep2", [*BALANCED, *ep2], stdlib_cache), one_process)


@pytest.fixture(scope="module")
def one_process_4_blocks(tmp_path_factory, stdlib_cache) -> Path:
    root = tmp_path_factory.mktemp("moe_balance_pp_one4")
    one = [*BALANCED, "model.args.n_layers=4", "cluster.nproc_per_node=1", "trainer.micro_batch_size=4"]
    return _run(root, "one4", one, stdlib_cache)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_two_stages_a_rank_route_the_step_ahead(one_process_4_blocks, tmp_path, stdlib_cache, schedule):
    """4 blocks, two stages on each of 2 ranks: interleaved 1F1B's forward-only step, and zbv's
    V, whose schedule has none, so there the pass ahead walks each microbatch through the stages
    in turn. Equal to one process."""
    four = [*BALANCED, "model.args.n_layers=4", *PP2, f"parallelism.pp_schedule={schedule}"]
    _assert_same(_run(tmp_path, schedule, [*four, "cluster.nproc_per_node=2"], stdlib_cache), one_process_4_blocks)
