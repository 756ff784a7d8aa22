"""stage=dpo through pipeline stages, through `main.py` ([Note: preference pairs through a
pipeline] in framework/dpo/pipeline.py): pp=2 under 1f1b and gpipe, and pp=2 x dp_shard=2, train
like one process on the same global batch: the losses, gradient norms and the pairs' statistics
of every step, the validation loss and statistics, and every weight after 5 steps; zbv likewise
(its reference passes run the stages in turn, its schedule having no forward-only step; no
validation, which zbv refuses); a checkpoint written at pp=2 resumes on two sharded ranks without a
pipeline with the same losses. interleaved_1f1b runs the reference as 1f1b and gpipe do (the
schedule's forward-only step): tests/integration/composition.py's "dpo tp pp/interleaved_1f1b"
(COMPOSITION_ALL=1) checks it, tensor parallel inside its stages, against one process.

8 pairs a step in micro-batches of 2 pairs: one process accumulates 4 of them; the pipeline runs 4
microbatches of 2 pairs (4 rows: the chosen two, then the rejected two), or 2 of 4 pairs where
parallelism.pp_microbatches=2 (one process's micro-batch means, each / 4, sum to the same mean over
the 8 pairs as two means of 4, each / 2). SGD with momentum, unclipped: a loss or gradient of the
wrong scale shows in the next steps' losses, which Adam would hide.

Tolerance 1e-5 as in test_pipeline.py: the same fp32 operations on the same rows; only the order
of sums differs (the gradient norm summed per stage, then over stages; the gradients of a
microbatch of 4 pairs against two of 2), a few ulps grown over 5 steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, read_metrics, run_main
from test_pipeline import _weights

STEPS = 5  # test_pipeline's `_weights` reads the checkpoint of this step
TOLERANCE = 1e-5  # see the module docstring
STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """A tokenizer.json and 44 plain preference records (4 held out for validation)."""
    from framework.data.tokenizer import EOD, train_bpe

    root = tmp_path_factory.mktemp("pp_dpo")
    texts = [f"Q: what is {i} plus {j}? A: {i + j}{EOD}" for i in range(11) for j in range(10)]
    train_bpe(texts, 300, str(root / "tok.json"))
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(11):
            for j in range(4):
                record = {"prompt": f"Q: what is {i} plus {j}? A:", "chosen": f" {i + j}", "rejected": f" {i + j + 1}"}
                f.write(json.dumps(record) + "\n")
    return root


def _run(pairs: Path, run: Path, *extra: str) -> Path:
    args = [a for a in TINY if not a.startswith("data=")] + ["data=hf", "stage=dpo", "model.args.n_layers=4"]
    args += ["optimizer=sgd", "optimizer.clip_grad_norm=0"]
    args += [f"data.paths=[{pairs / 'pairs.jsonl'}]", f"finetune.tokenizer={pairs / 'tok.json'}"]
    args += ["data.seq_len=24", "data.hf.valid_documents=4", "trainer.micro_batch_size=2"]
    args += ["trainer.global_batch_size=8", f"trainer.max_steps={STEPS}", "trainer.log_interval=1"]
    args += ["trainer.eval_interval=5", "checkpoint.save_final=true", f"hydra.run.dir={run}", *extra]
    out = run_main(args, pairs)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run


def _steps(run: Path) -> list:
    return [r for r in read_metrics(run) if "loss" in r and "step" in r]


@pytest.fixture(scope="module")
def one(pairs) -> Path:
    return _run(pairs, pairs / "one", "cluster.nproc_per_node=1")


def _same_as_one_process(run: Path, one: Path, validated: bool = True) -> None:
    mine, ref = _steps(run), _steps(one)
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1))
    assert abs(mine[0]["loss"] - math.log(2)) < 1e-6  # the policy starts as the reference
    for got, want in zip(mine, ref):
        for name in ("loss", "grad_norm", *STATS):
            assert got[name] == pytest.approx(want[name], abs=TOLERANCE), (name, got, want)
    assert mine[-1]["rewards/margins"] != 0.0  # the policy moved away from the reference
    val = [r for r in read_metrics(run) if "val_loss" in r]
    if validated:
        want = [r for r in read_metrics(one) if "val_loss" in r]
        assert len(val) == len(want) == 1
        for name in ("val_loss", "val_rewards/margins", "val_logps/chosen"):
            assert val[0][name] == pytest.approx(want[0][name], abs=TOLERANCE), (name, val, want)
    weights, ref_weights = _weights(run), _weights(one)
    assert sorted(weights) == sorted(ref_weights)
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, atol=TOLERANCE, rtol=0, msg=name)


PIPELINES = {
    "1f1b": ["parallelism.pp_schedule=1f1b"],
    "gpipe": ["parallelism.pp_schedule=gpipe", "parallelism.pp_microbatches=2", "parallelism.pp_split=[3,1]"],
    "zbv": ["parallelism.pp_schedule=zbv", "parallelism.pp_split=[1,1,1,1]", "trainer.eval_interval=0"],
}


@pytest.fixture(scope="module")
def pp_1f1b(pairs) -> Path:
    """pp=2 under 1f1b, a checkpoint after step 3."""
    pp = ["cluster.nproc_per_node=2", "parallelism.pp=2", "checkpoint.interval=3"]
    return _run(pairs, pairs / "pp_1f1b", *pp, *PIPELINES["1f1b"])


def test_dpo_at_pp2_1f1b_equals_one_process(pp_1f1b, one):
    _same_as_one_process(pp_1f1b, one)


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_dpo_at_pp2_equals_one_process(pairs, one, schedule):
    """gpipe with 2 microbatches of 4 pairs cut unevenly (3 blocks, then 1 and the head); zbv with
    rank 0 holding the first and the last stage."""
    run = _run(pairs, pairs / schedule, "cluster.nproc_per_node=2", "parallelism.pp=2", *PIPELINES[schedule])
    _same_as_one_process(run, one, validated=schedule != "zbv")


def test_dpo_at_pp2_with_dp_shard2_equals_one_process(pairs, one):
    """Our engine shards each stage over 2 ranks: each data-parallel rank's 4 pairs in 2 microbatches."""
    overrides = ["cluster.nproc_per_node=4", "parallelism.pp=2", "parallelism.dp_shard=2"]
    _same_as_one_process(_run(pairs, pairs / "pp_dp", *overrides), one)


def test_a_pp2_checkpoint_resumes_on_two_sharded_ranks_with_the_same_losses(pairs, pp_1f1b, one):
    step = pp_1f1b / "checkpoints" / "step_00000003"
    run = _run(pairs, pairs / "resumed", "cluster.nproc_per_node=2", f"checkpoint.resume={step}")
    resumed, straight = _steps(run), _steps(pp_1f1b)
    assert [r["step"] for r in resumed] == [4, 5]
    for got, want in zip(resumed, straight[3:]):
        for name in ("loss", "grad_norm", *STATS):
            assert got[name] == pytest.approx(want[name], abs=TOLERANCE), (name, got, want)
    weights, ref_weights = _weights(run), _weights(one)
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, atol=TOLERANCE, rtol=0, msg=name)


def test_validation_lets_dpo_and_grpo_into_a_pipeline(pairs):
    """Before any rank starts: stage=dpo and stage=grpo at pp=2 pass validation (both were refused;
    GRPO's pipeline: tests/finetune/test_grpo.py's `test_pipeline_stages_equal_one_process`)."""
    from framework.config import compose_config, to_config, validate

    common = ["data=hf", f"data.paths=[{pairs / 'pairs.jsonl'}]", "parallelism.pp=2", "model=debug"]
    for stage in ("dpo", "grpo"):
        assert validate(to_config(compose_config([f"stage={stage}", *common])), world_size=2) == [], stage
