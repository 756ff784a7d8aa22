"""The resharding matrix through `main.py` and the CheckpointManager, as a user would resume.

One uninterrupted run at dp_shard=2 x tp=2 with sequence parallelism (4 local ranks) saves after
step 3 and trains on to step 6. Its step-3 checkpoint is then resumed at tp=1 x dp=2,
tp=2 x dp=1 and on one rank; each must log the uninterrupted run's losses for steps 4-6.
(tests/tp/test_tp_training.py checks the same matrix on the final parameters, through DCP directly.)

Tolerance 1e-5 as in [Note: tolerance of the tensor-parallel comparisons] (test_tp_training.py):
the layouts sum the same numbers in other orders (tensor-parallel partial sums, dp gradient
averaging, the one-rank run's two accumulation micro-batches). SGD, so a gradient scaled by the
layout would show.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import TINY, read_metrics, run_main

COMMON = TINY + [
    "parallelism.engine=torch",
    "optimizer=sgd",
    "trainer.max_steps=6",
    "trainer.eval_interval=0",
    "checkpoint.save_final=false",
    "checkpoint.keep_last=5",
]
TARGETS = {  # name: overrides of the resumed run
    "tp1xdp2": ["cluster.nproc_per_node=2", "parallelism.tp=1"],
    "tp2xdp1": ["cluster.nproc_per_node=2", "parallelism.tp=2"],
    "one_rank": ["cluster.nproc_per_node=1", "parallelism.tp=1"],
}


def _losses(run_dir: Path) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


@pytest.fixture(scope="module")
def source() -> Path:
    # Not tmp_path_factory: pytest prunes all but its last 3 base temp dirs whenever a session
    # starts, so a concurrent pytest run (other checkouts, CI on the same user) could delete the
    # checkpoint between this fixture and the tests that resume it.
    with tempfile.TemporaryDirectory(prefix="tp_resume_") as tmp:
        yield from _source(Path(tmp))


def _source(root: Path):
    out = run_main(
        COMMON
        + [
            "cluster.nproc_per_node=4",
            "parallelism.tp=2",
            "parallelism.sequence_parallel=true",
            "checkpoint.interval=3",
            f"hydra.run.dir={root}/source",
        ],
        root,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    yield root / "source"


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_resume_dp2_tp2_checkpoint_in_another_layout(source, tmp_path, target):
    ckpt = source / "checkpoints" / "step_00000003"
    assert ckpt.is_dir(), sorted(p.name for p in (source / "checkpoints").iterdir())
    out = run_main(COMMON + TARGETS[target] + [f"checkpoint.resume={ckpt}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stderr
    want, got = _losses(source), _losses(tmp_path / "run")
    assert sorted(got) == [4, 5, 6], f"resumed run logged steps {sorted(got)}"
    for step in (4, 5, 6):
        assert abs(got[step] - want[step]) <= 1e-5, (
            f"step {step} after resuming at {target}: loss {got[step]:.8f}, uninterrupted dp2 x tp2 {want[step]:.8f}"
        )
