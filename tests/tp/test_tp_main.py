"""`python main.py parallelism.tp=2 ...` as a user types it, and what validation says about tp.

The end-to-end runs go through everything the spawned tests skip: Hydra composition, validation,
local rank start, the Trainer's loss under `loss_parallel` and its gradient clipping.
"""

from __future__ import annotations

import logging

import pytest
from conftest import TINY, read_metrics, run_main

from framework.config.schema import Config
from framework.config.validate import validate

STEPS = [
    "trainer.max_steps=4",
    "trainer.eval_interval=4",
    "trainer.eval_iters=1",
    "checkpoint.save_final=false",
    "parallelism.engine=torch",
    "optimizer=sgd",
]


def _losses(run_dir):
    return [(row["step"], row["loss"]) for row in read_metrics(run_dir) if "loss" in row]


def test_main_tp2_trains_like_one_process(tmp_path):
    """tp=2 on 2 local ranks (dp=1) sees the same batches as one process: same losses.
    Tolerance 1e-5 as in [Note: tolerance of the tensor-parallel comparisons] (test_tp_training.py)."""
    tp = run_main(
        TINY
        + STEPS
        + [
            "cluster.nproc_per_node=2",
            "parallelism.tp=2",
            "parallelism.sequence_parallel=true",
            f"hydra.run.dir={tmp_path}/tp2",
        ],
        tmp_path,
    )
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    one = run_main(TINY + STEPS + ["cluster.nproc_per_node=1", f"hydra.run.dir={tmp_path}/one"], tmp_path)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    got, want = _losses(tmp_path / "tp2"), _losses(tmp_path / "one")
    assert [s for s, _ in got] == [1, 2, 3, 4]
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= 1e-5, f"step {step}: tp=2 loss {a:.8f}, one process {b:.8f}"
    val = [row["val_loss"] for row in read_metrics(tmp_path / "tp2") if "val_loss" in row]
    val_one = [row["val_loss"] for row in read_metrics(tmp_path / "one") if "val_loss" in row]
    assert len(val) == 1 and abs(val[0] - val_one[0]) <= 1e-5


def test_main_refuses_tp_that_does_not_divide_heads(tmp_path):
    out = run_main(
        TINY
        + STEPS
        + [
            "cluster.nproc_per_node=2",
            "parallelism.dp_shard=1",
            "parallelism.tp=2",
            "model.args.n_kv_heads=1",
            f"hydra.run.dir={tmp_path}/bad",
        ],
        tmp_path,
    )
    assert out.returncode == 2
    assert "model.args.n_kv_heads=1 is not divisible by parallelism.tp=2" in out.stderr


def _cfg(**parallelism) -> Config:
    from framework.config.schema import ClusterConfig, ModelConfig, ParallelismConfig

    cfg = Config()
    cfg.model = ModelConfig(args={"vocab_size": parallelism.pop("vocab", 256), "n_kv_heads": 4})  # tp=4 divides it
    cfg.cluster = ClusterConfig(nproc_per_node=parallelism.pop("nproc_per_node", 2), nodes=parallelism.pop("nodes", 1))
    cfg.parallelism = ParallelismConfig(**parallelism)
    cfg.trainer.global_batch_size = 8
    cfg.trainer.micro_batch_size = 1
    return cfg


def test_validation_says_uneven_vocabulary(caplog):
    from framework.models.families import job_model_problems  # the model's own checks (its family's)

    with caplog.at_level(logging.WARNING, logger="framework.config"):
        cfg = _cfg(tp=2, dp_shard=1, vocab=255)
        problems = validate(cfg, world_size=2) + job_model_problems(cfg)
    assert problems == []  # uneven shards are exact (test_tp2_uneven_vocabulary_matches_single_process)
    assert "vocabulary size 255 is not divisible by parallelism.tp=2" in caplog.text
    assert "pad model.args.vocab_size to 256" in caplog.text


def test_validation_warns_tp_across_nodes(caplog):
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        problems = validate(_cfg(tp=4, dp_shard=2, nodes=4, nproc_per_node=2), world_size=8)
    assert problems == []
    assert "tensor-parallel groups span nodes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        validate(_cfg(tp=2, dp_shard=4, nodes=4, nproc_per_node=2), world_size=8)
    assert caplog.text == ""


@pytest.mark.parametrize("vocab", [256, 512])
def test_validation_quiet_for_even_vocabulary(caplog, vocab):
    with caplog.at_level(logging.WARNING, logger="framework.config"):
        assert validate(_cfg(tp=2, dp_shard=1, vocab=vocab), world_size=2) == []
    assert caplog.text == ""
