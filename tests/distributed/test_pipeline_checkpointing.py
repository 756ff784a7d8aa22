"""parallelism.activation_checkpointing under a pipeline: each stage's blocks are wrapped as
`parallelize` wraps them (recomputed in backward), and the step's loss and gradients equal one
process's without checkpointing, under 1f1b and under zbv.

Each rank builds the trainer's Pipeline (pp=2, activation_checkpointing=full) and counts how often
each block's attention runs (a forward hook on the submodule: the recomputation calls it too).
Without recomputation a block runs once per microbatch. Under 1f1b it runs twice (the forward, the
backward's recomputation). Under zbv a stage that is not the first splits its backward in two: its
input half recomputes the block once and its weight half once, all the block's weight groups in one
autograd call (one call per group recomputes it once per group: 11 runs per microbatch, not 3,
when this was written).

Tolerance 1e-6: the recomputation repeats the forward's operations on the same values, so the
gradients are those of one process up to the order of float32 sums (the engine's accumulation
buffer, autograd's .grad); values of 1e-3..1."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed.harness import run_ranks

M = 4  # microbatches
BASE = [
    "model=debug",
    "model.args.n_layers=4",
    "data=synthetic",
    "parallelism.pp=2",
    "parallelism.activation_checkpointing=full",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    "cluster.nproc_per_node=2",
]
SCHEDULES = {"1f1b": [], "zbv": ["parallelism.pp_split=[1,1,1,1]"]}


def _rank(rank: int, world: int, schedule: str) -> dict:
    from framework.config import compose_config, to_config
    from framework.config.validate import parallel_dims_of
    from framework.distributed.parallel_dims import build_mesh
    from framework.distributed.pipeline import Pipeline
    from framework.models import family_of
    from framework.models.tasks import cross_entropy

    overrides = BASE + [f"parallelism.pp_schedule={schedule}"] + SCHEDULES[schedule]
    cfg = to_config(compose_config(overrides))
    dims = parallel_dims_of(cfg, world)
    mesh = build_mesh(dims, "cpu")
    family = family_of(cfg.model)
    model = family.build(cfg.model, "cpu")
    family.init_weights(model, 0)
    reference = copy.deepcopy(model)
    runs = [0] * len(model.layers)
    for i, block in enumerate(model.layers):
        block.attention.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
    pipe = Pipeline(model, dims, mesh, cfg, family, torch.device("cpu"), M, family.task(cfg.model), cross_entropy)
    g = torch.Generator().manual_seed(1)
    vocab, seq = cfg.model.args["vocab_size"], cfg.data.seq_len
    batches = [
        (torch.randint(0, vocab, (2, seq), generator=g), torch.randint(0, vocab, (2, seq), generator=g))
        for _ in range(M)
    ]
    loss = pipe.train_batches(batches)

    ref_loss = torch.zeros(())
    for inputs, labels in batches:  # one process, no checkpointing: accumulation over the same microbatches
        part = cross_entropy(reference(inputs), labels) / M
        part.backward()
        ref_loss += part.detach()
    grads = dict(reference.named_parameters())
    diffs = {}
    for name, p in pipe.model.named_parameters():
        assert p.grad is not None, f"rank {rank}: {name} has no gradient after the step"
        diffs[name] = (p.grad.reshape(-1) - grads[name].grad.reshape(-1)).abs().max().item()
    layers_of = {}  # stage index -> the blocks it holds (their indices in the whole model)
    held = {id(b): i for i, b in enumerate(model.layers)}
    for stage in pipe.stages:
        layers_of[stage.stage_index] = [held[id(m)] for m in stage.submod.modules() if id(m) in held]
    return {
        "runs": runs,
        "layers_of": layers_of,
        "first": [s.stage_index for s in pipe.stages if s.is_first],
        "loss": (loss.item(), ref_loss.item()),
        "diffs": diffs,
    }


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_checkpointed_stages_recompute_and_equal_one_process(schedule):
    results = run_ranks(_rank, 2, args=(schedule,), timeout_s=300)
    seen = set()
    for rank, r in enumerate(results):
        for stage, layers in r["layers_of"].items():
            assert layers, (rank, stage)
            # 1f1b, or zbv's first stage (its inputs, the tokens, need no gradient: one whole backward)
            whole = schedule == "1f1b" or stage in r["first"]
            for i in layers:
                assert r["runs"][i] == (2 if whole else 3) * M, (rank, stage, i, r["runs"])
                seen.add(i)
        loss, ref = r["loss"]
        assert abs(loss - ref) < 1e-6, (rank, loss, ref)
        for name, diff in r["diffs"].items():
            assert diff < 1e-6, (rank, name, diff)  # see the module docstring
    assert seen == {0, 1, 2, 3}
