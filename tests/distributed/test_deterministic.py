"""`trainer.deterministic=true`: the same global batch on 1, 2 and 4 gloo ranks, under every strategy
and micro-batch split, gives losses, gradient norms and final weights `torch.equal` to one rank's
(docs/engine.md "Deterministic mode"); a checkpoint written at 4 ranks continues at 2 and 1 with the
same bits; without the mode the same runs differ (so the equality is the mode's, not luck); the
layouts the mode cannot keep are refused before any rank starts.

Comparisons are exact (`torch.equal`, `==` on the logged floats): no tolerance, that is the point.
The model is the debug Llama (0.1M parameters) on synthetic data, a global batch of 16 sequences
of 16 tokens cut into units of one sequence: enough units for 4 ranks x 4 accumulation steps.

Cost: one spawn per world size runs all its layouts in turn. The default suite runs STEPS steps of
a covering subset: every world size, every strategy (full, hybrid 2x2, grad_op, no_shard), every
accumulation split (1, 2, 4) and both optimizers appear, each pairing of a world size with a
strategy once or more; `DETERMINISTIC_FULL=1` runs the whole product (3 worlds x strategies x
splits x {AdamW, Muon}) on 16 sequences per step for 30 steps. Without the mode the gradient
norms and the weights already differ within 3 steps (asserted by
`test_without_the_mode_layouts_differ`; measured: all 21 weights), so 6 steps measure the mode: a rounding difference in
any weight is carried by every later step, never repaired.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from conftest import TINY

from tests.distributed.harness import run_ranks

FULL = os.environ.get("DETERMINISTIC_FULL") == "1"
STEPS = 30 if FULL else 6
GLOBAL = 16 if FULL else 8  # sequences per step: units of one sequence, 4 ranks x 4 micro-batches for FULL
BASE = TINY + [
    "data.seq_len=16",
    f"trainer.global_batch_size={GLOBAL}",
    "trainer.eval_interval=0",
    "trainer.log_interval=1",
    "trainer.deterministic_unit=1",
    "optimizer.clip_grad_norm=0.05",  # small enough to clip: the norm's bits decide the step
    "optimizer.warmup_steps=0",
]
STRATEGIES = {
    "full": ["parallelism.strategy=full"],
    "grad_op": ["parallelism.strategy=grad_op"],
    "no_shard": ["parallelism.strategy=no_shard"],
    "hybrid": ["parallelism.strategy=hybrid", "parallelism.dp_replicate=2", "parallelism.dp_shard=2"],
}


def _layout(world: int, strategy: str, accum: int, optimizer: str, deterministic: bool = True) -> list:
    micro = GLOBAL // (world * accum)
    return (
        STRATEGIES[strategy]
        + [f"trainer.micro_batch_size={micro}", f"optimizer={optimizer}", f"trainer.deterministic={deterministic}"]
        + (["parallelism.dp_shard=-1"] if strategy in ("full", "grad_op") else [])
    )


def _train(rank, world, layouts, steps, run_dir, save_at=None, resume=None):
    """Each layout trained `steps` steps on this world; returns per layout (losses, grad norms,
    the final full weights on rank 0 as numpy arrays)."""
    import torch

    from framework.config import to_config
    from framework.config.compose import compose_config
    from framework.job import build_job
    from framework.runtime import Runtime
    from framework.trainer import Trainer

    results = []
    for k, overrides in enumerate(layouts):
        extra = [f"checkpoint.dir={run_dir}/ckpt", "checkpoint.save_final=true"]
        if resume is not None:
            extra.append(f"checkpoint.resume={resume}")
        cfg = to_config(compose_config(BASE + overrides + extra + [f"trainer.max_steps={steps}"]))
        cfg.run_dir = f"{run_dir}/{k}"
        trainer = Trainer(build_job(cfg, Runtime(rank, world, rank, torch.device("cpu"))))
        if resume is not None:
            trainer.state.step = trainer.ckpt.resume(trainer.state)
        losses, norms = [], []
        while trainer.state.step < steps:
            out = trainer.train_step(read=True)
            trainer.state.step += 1
            losses.append(out["loss"])
            norms.append(out["grad_norm"])
            if save_at is not None and trainer.state.step == save_at:
                trainer.ckpt.save(trainer.state, blocking=True)
        model_sd, _ = trainer.engine.get_state_dicts(trainer.model, trainer.optimizer)
        weights = {name: v.full_tensor().numpy().copy() for name, v in model_sd.items()}
        trainer.ckpt.close()
        del trainer, model_sd
        gc.collect()
        results.append((losses, norms, weights if rank == 0 else None))
    return results


def _same(a, b, what: str) -> None:
    assert a[0] == b[0], f"{what}: losses {a[0]} != {b[0]}"
    assert a[1] == b[1], f"{what}: grad norms {a[1]} != {b[1]}"
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert np.array_equal(a[2][name], b[2][name]), f"{what}: weight {name} differs"


def _plan():
    """{world: [(strategy, accum, optimizer)]}: the whole product, or the covering subset."""
    opts = ("adamw", "muon")
    if FULL:
        return {
            1: [("full", a, o) for a in (1, 2, 4) for o in opts],
            2: [(s, a, o) for s in ("full", "grad_op", "no_shard") for a in (1, 2, 4) for o in opts],
            4: [(s, a, o) for s in ("full", "hybrid", "grad_op") for a in (1, 2, 4) for o in opts],
        }
    return {
        1: [("full", 1, "adamw"), ("full", 2, "muon")],
        2: [("grad_op", 4, "adamw"), ("no_shard", 1, "muon")],
        4: [("hybrid", 1, "adamw"), ("full", 2, "muon")],
    }


def test_every_layout_gives_one_rank_bits(tmp_path):
    plan = _plan()
    got = {}
    for world, runs in plan.items():
        layouts = [_layout(world, s, a, o) for s, a, o in runs]
        out = run_ranks(_train, world_size=world, args=(layouts, STEPS, str(tmp_path / f"w{world}")), timeout_s=900)
        for run, result in zip(runs, out[0]):
            got[(world,) + run] = result
    references = {o: got[(1, "full", a, o)] for (w, s, a, o) in got if w == 1}
    for (world, strategy, accum, opt), result in got.items():
        _same(result, references[opt], f"{world} ranks {strategy} accum {accum} {opt}")
    # each optimizer moved the weights: the comparisons are of trained models
    assert got[(1, "full", 1, "adamw")][0][0] != got[(1, "full", 1, "adamw")][0][-1]


def test_without_the_mode_layouts_differ(tmp_path):
    """The same pair of layouts with trainer.deterministic=false: 1 rank x 4 micro-batches against
    2 ranks x 1 differ (summation order), which the mode removes (the test above)."""
    one = run_ranks(_train, world_size=1, args=([_layout(1, "full", 4, "adamw", False)], 3, str(tmp_path / "a")))
    two = run_ranks(_train, world_size=2, args=([_layout(2, "full", 1, "adamw", False)], 3, str(tmp_path / "b")))
    (_, n1, w1), (_, n2, w2) = one[0][0], two[0][0]
    differ = sum(not np.array_equal(w1[k], w2[k]) for k in w1)
    assert differ > 0 and n1 != n2, (differ, n1, n2)


def test_checkpoint_at_four_ranks_resumes_at_two_and_one_with_the_same_bits(tmp_path):
    steps, save_at = 6, 3
    layout4 = _layout(4, "full", 1, "adamw")
    whole = run_ranks(_train, world_size=1, args=([_layout(1, "full", 4, "adamw")], steps, str(tmp_path / "ref")))
    ref = whole[0][0]
    run_ranks(_train, world_size=4, args=([layout4], steps, str(tmp_path / "src"), save_at), timeout_s=600)
    ckpt = tmp_path / "src" / "ckpt" / f"step_{save_at:08d}"
    assert ckpt.is_dir()
    for world, accum in ((2, 2), (1, 1)):
        out = run_ranks(
            _train,
            world_size=world,
            args=([_layout(world, "full", accum, "adamw")], steps, str(tmp_path / f"r{world}"), None, str(ckpt)),
        )
        losses, norms, weights = out[0][0]
        assert losses == ref[0][save_at:], f"resumed at {world} ranks"
        assert norms == ref[1][save_at:]
        for name in weights:
            assert np.array_equal(weights[name], ref[2][name]), f"resumed at {world} ranks: {name}"


REFUSED = {
    "tp": (["parallelism.tp=2", "cluster.nproc_per_node=2"], "trainer.deterministic=true with parallelism.tp=2"),
    "cp": (["parallelism.cp=2", "cluster.nproc_per_node=2", "data.seq_len=32"], "with parallelism.cp=2"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_tp_and_cp_refused_in_one_line_before_any_rank_starts(tmp_path, case):
    from conftest import run_main

    overrides, expected = REFUSED[case]
    run = tmp_path / "run"
    args = [*TINY, *overrides, "trainer.deterministic=true", "trainer.max_steps=2", f"hydra.run.dir={run}"]
    out = run_main(args, tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], out.stderr[-2000:]
    assert not run.exists()  # no rank claimed the run directory


def test_what_the_mode_cannot_keep_is_refused_by_validation():
    from framework.config import to_config
    from framework.config.compose import compose_config
    from framework.config.validate import validate

    def problems(*overrides):
        return validate(to_config(compose_config([*TINY, "trainer.deterministic=true", *overrides])), world_size=2)

    assert problems("cluster.nproc_per_node=2") == []
    pp = problems("parallelism.pp=2", "cluster.nproc_per_node=2")
    assert any(p.startswith("trainer.deterministic=true with parallelism.pp=2: a pipeline schedule") for p in pp), pp
    # 24 / (2 ranks x 4) = 3 units per rank: no subtree of the sum
    odd = problems("trainer.micro_batch_size=4", "trainer.global_batch_size=24")
    assert any("3 units per data-parallel rank" in p for p in odd), odd
    unit = problems("trainer.micro_batch_size=4", "trainer.deterministic_unit=3")
    assert any("trainer.deterministic_unit=3 does not divide" in p for p in unit), unit
    assert any("engine=torch" in p for p in problems("parallelism.engine=torch"))
