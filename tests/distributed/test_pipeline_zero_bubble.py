"""zbv's weight gradients are computed apart from, and after, its input gradients: the schedule's
I action computes only what is sent upstream, its W action the weights' gradients (through
autograd's accumulation, so the engine's gradient hooks run then), and the step's gradients
equal one process's accumulated over the same microbatches.

Each rank builds the trainer's Pipeline (pp=2, zbv: 4 stages of one block, rank 0 holding stages
0 and 3) and records, per backward action of each stage, how many of its weights autograd
accumulated a gradient into (a post-accumulate-grad hook on every unsharded parameter of its
units). Tolerance 1e-6: the same operations on the same microbatches, summed in the same order
(the engine's accumulation buffer, autograd's .grad); values of 1e-3..1."""

from __future__ import annotations

import copy

import torch

from tests.distributed.harness import run_ranks

M = 4  # microbatches
OVERRIDES = [
    "model=debug",
    "model.args.n_layers=4",
    "data=synthetic",
    "parallelism.pp=2",
    "parallelism.pp_schedule=zbv",
    "parallelism.pp_split=[1,1,1,1]",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    "cluster.nproc_per_node=2",
]


def _zbv_rank(rank: int, world: int) -> dict:
    from framework.config import compose_config, to_config
    from framework.config.validate import parallel_dims_of
    from framework.distributed.fsdp.unit import sharded_units
    from framework.distributed.parallel_dims import build_mesh
    from framework.distributed.pipeline import Pipeline
    from framework.models import family_of
    from framework.models.tasks import cross_entropy

    cfg = to_config(compose_config(OVERRIDES))
    dims = parallel_dims_of(cfg, world)
    mesh = build_mesh(dims, "cpu")
    family = family_of(cfg.model)
    model = family.build(cfg.model, "cpu")
    family.init_weights(model, 0)
    reference = copy.deepcopy(model)
    pipe = Pipeline(model, dims, mesh, cfg, family, torch.device("cpu"), M, family.task(cfg.model), cross_entropy)

    accumulated = {s.stage_index: 0 for s in pipe.stages}  # gradients autograd stored, per stage
    trainable = {}
    for stage in pipe.stages:
        fulls = [f for u in sharded_units(stage.submod) for f, e in zip(u.full_params, u.entries) if e.requires_grad]
        trainable[stage.stage_index] = len(fulls)
        for f in fulls:
            f.register_post_accumulate_grad_hook(
                lambda _, s=stage.stage_index: accumulated.__setitem__(s, accumulated[s] + 1)
            )
    actions = []  # (stage, backward kind, weights accumulated during it)

    def watch(stage):
        run = stage.backward_maybe_with_nosync

        def watched(kind, kwargs, last_backward=False):
            before = accumulated[stage.stage_index]
            out = run(kind, kwargs, last_backward=last_backward)
            actions.append((stage.stage_index, kind, accumulated[stage.stage_index] - before))
            return out

        stage.backward_maybe_with_nosync = watched

    for stage in pipe.stages:
        watch(stage)
    g = torch.Generator().manual_seed(1)
    vocab, seq = cfg.model.args["vocab_size"], cfg.data.seq_len
    batches = [
        (torch.randint(0, vocab, (2, seq), generator=g), torch.randint(0, vocab, (2, seq), generator=g))
        for _ in range(M)
    ]
    loss = pipe.train_batches(batches)

    ref_loss = torch.zeros(())
    for inputs, labels in batches:  # one process: gradient accumulation over the same microbatches
        part = cross_entropy(reference(inputs), labels) / M
        part.backward()
        ref_loss += part.detach()
    grads = dict(reference.named_parameters())
    diffs = {}
    for name, p in pipe.model.named_parameters():
        assert p.grad is not None, f"rank {rank}: {name} has no gradient after the step"
        diffs[name] = (p.grad.reshape(-1) - grads[name].grad.reshape(-1)).abs().max().item()
    return {
        "actions": actions,
        "trainable": trainable,
        "weight_passes": {s.stage_index: getattr(s, "weight_passes", 0) for s in pipe.stages},  # 0: none counted
        "first": [s.stage_index for s in pipe.stages if s.is_first],
        "loss": (loss.item(), ref_loss.item()),
        "diffs": diffs,
    }


def test_zbv_defers_the_weight_gradients_and_equals_one_process():
    results = run_ranks(_zbv_rank, 2, timeout_s=300)
    for rank, r in enumerate(results):
        by_stage: dict = {}
        for stage, kind, n in r["actions"]:
            by_stage.setdefault(stage, []).append((kind, n))
        assert sorted(by_stage) == sorted(r["trainable"]), (rank, by_stage)
        for stage, acts in by_stage.items():
            want = r["trainable"][stage]
            if stage in r["first"]:  # its inputs (tokens) need no gradient: its W is its whole backward
                assert acts == [("full", want)] * M, (rank, stage, acts)
                continue
            inputs = [n for kind, n in acts if kind == "input"]
            weights = [n for kind, n in acts if kind == "weight"]
            # every input half stored no weight gradient; every weight half stored each weight's once
            assert inputs == [0] * M and weights == [want] * M and len(acts) == 2 * M, (rank, stage, acts)
            assert r["weight_passes"][stage] == M
        loss, ref = r["loss"]
        assert abs(loss - ref) < 1e-6, (rank, loss, ref)
        for name, diff in r["diffs"].items():
            assert diff < 1e-6, (rank, name, diff)  # see the module docstring
