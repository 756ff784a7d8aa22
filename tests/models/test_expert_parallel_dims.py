"""Expert parallelism with the other dimensions (framework/distributed/expert_parallel.py): each
layout of `model=moe_debug` on 4 gloo ranks trains as one process does on the same global batch
(losses, grad norms and every weight after the run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, read_metrics, run_main

MOE = [a for a in TINY if not a.startswith("data=")] + [
    "model=moe_debug",
    "trainer.eval_interval=0",
    "trainer.max_steps=4",
    "checkpoint.save_final=true",
    "optimizer=sgd",  # momentum SGD: a wrongly scaled gradient moves the weights (Adam would rescale it)
]
# fp32 throughout; the ranks add the same terms as one process in another order (reduce-scatter,
# all-reduce over replicas, rows of an expert from several ranks): a few ulps per step, far below
# 1e-5 after 4 steps, while a wrongly scaled expert gradient (dp_shard instead of dp) moves the
# grad norm by percents.
TOL = 1e-5


def _run(root: Path, name: str, overrides: list, stdlib_cache: str) -> Path:
    run = root / name
    out = run_main([*MOE, stdlib_cache, *overrides, f"hydra.run.dir={run}"], root)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


def _weights(run: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = sorted((run / "checkpoints").iterdir())[-1]
    dcp_to_torch_save(str(final), str(run / "final.pt"))
    state = torch.load(run / "final.pt", weights_only=False)
    model = state["model"] if "model" in state else state
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def _assert_same(run: Path, reference: Path) -> None:
    got, want = read_metrics(run), read_metrics(reference)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], abs=TOL)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], abs=TOL)
    # the router statistics: the same keys and loads (the same tokens routed by weights equal
    # within TOL, so the same choices; counts are exact); tp ranks route the same tokens, counted once
    stats = [[{k: v for k, v in r.items() if k.startswith("moe_load")} for r in run] for run in (got, want)]
    assert stats[0] == stats[1] and stats[1][0]
    w_got, w_want = _weights(run), _weights(reference)
    assert set(w_got) == set(w_want) and any("experts" in k for k in w_got)
    for key in w_want:
        assert (w_got[key] - w_want[key]).abs().max().item() < TOL, key


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, stdlib_cache) -> Path:
    """4 samples a step on one process: the global batch of 4 ranks at micro-batch 1."""
    root = tmp_path_factory.mktemp("moe_one")
    return _run(root, "one", ["cluster.nproc_per_node=1", "trainer.micro_batch_size=4"], stdlib_cache)


def test_ep_with_hybrid_sharding_equals_one_process(one_process, tmp_path, stdlib_cache):
    """ep=2 x HSDP on 4 ranks (dp_replicate=2, dp_shard=2): each replica splits the experts over
    its 2 ranks, the experts' gradients are averaged over the replicas; equal to one process."""
    run = _run(
        tmp_path,
        "hsdp",
        [
            "cluster.nproc_per_node=4",
            "parallelism.strategy=hybrid",
            "parallelism.dp_replicate=2",
            "parallelism.dp_shard=2",
            "parallelism.ep=2",
        ],
        stdlib_cache,
    )
    _assert_same(run, one_process)


GLOBAL = ["model.args.aux_loss_scope=global_batch"]  # the shares of the whole step: any split of it


@pytest.fixture(scope="module")
def one_process_global(tmp_path_factory, stdlib_cache) -> Path:
    root = tmp_path_factory.mktemp("moe_one_global")
    return _run(root, "one", [*GLOBAL, "cluster.nproc_per_node=1", "trainer.micro_batch_size=4"], stdlib_cache)


def test_ep_with_context_parallel_equals_one_process(one_process_global, tmp_path, stdlib_cache):
    """ep=2 x cp=2 on 4 ranks (dp_shard=2): each cp rank routes its half of every sequence and
    exchanges those tokens with the other dp_shard rank of its ep group; each expert is sharded
    over its 2 cp ranks. With global-batch balancing, equal to one process."""
    run = _run(
        tmp_path,
        "cp",
        [
            *GLOBAL,
            "cluster.nproc_per_node=4",
            "parallelism.dp_shard=2",
            "parallelism.cp=2",
            "parallelism.ep=2",
            "trainer.micro_batch_size=2",
        ],
        stdlib_cache,
    )
    _assert_same(run, one_process_global)


@pytest.mark.parametrize(
    "ep, sequence_parallel", [(2, False), (2, True), (1, False)], ids=["ep2_tp", "ep2_tp_sp", "ep1_tp"]
)
def test_ep_with_tensor_parallel_equals_one_process(one_process_global, tmp_path, stdlib_cache, ep, sequence_parallel):
    """ep=2 x tp=2 on 4 ranks (dp_shard=2), with and without sequence parallelism: attention, the
    dense layers and the shared expert split by tp; the router and the routed experts whole on
    every tp rank, split by expert over the 2 dp_shard ranks of each tp index ([Note: experts
    under tensor parallelism]). And experts with tp=2 alone (ep=1: the experts in their block's
    unit, sharded over dp_shard). Equal to one process."""
    run = _run(
        tmp_path,
        "tp",
        [
            *GLOBAL,
            "cluster.nproc_per_node=4",
            "parallelism.dp_shard=2",
            "parallelism.tp=2",
            f"parallelism.ep={ep}",
            f"parallelism.sequence_parallel={str(sequence_parallel).lower()}",
            "trainer.micro_batch_size=2",
        ],
        stdlib_cache,
    )
    _assert_same(run, one_process_global)
