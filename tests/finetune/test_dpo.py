"""stage=dpo through main.py: the first loss is ln 2, 1 rank, 2 sharded ranks, tensor parallelism and
torch's FSDP2 agree, a resume is exact, the reference is the starting model (imported, or LoRA's base),
refusals (the losses and the records in one process: tests/finetune/test_dpo_loss.py)."""

from __future__ import annotations

import json
import math

import pytest

# ---- jobs through main.py -------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A tokenizer.json and a JSONL file of 40 plain preference records (4 held out)."""
    from framework.data.tokenizer import EOD, train_bpe

    root = tmp_path_factory.mktemp("dpo")
    texts = [f"Q: what is {i} plus {j}? A: {i + j}{EOD}" for i in range(10) for j in range(10)]
    train_bpe(texts, 300, str(root / "tok.json"))
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(10):
            for j in range(4):
                record = {"prompt": f"Q: what is {i} plus {j}? A:", "chosen": f" {i + j}", "rejected": f" {i + j + 1}"}
                f.write(json.dumps(record) + "\n")
    return root


def _dpo(pairs, run_dir, *extra):
    from conftest import TINY

    # SGD with momentum, unclipped: a gradient of the wrong scale (a mean over the wrong pairs) shows
    # in the next steps' losses, where Adam's normalisation or clipping would hide it.
    args = [a for a in TINY if not a.startswith("data=")] + ["data=hf", "stage=dpo", "optimizer=sgd"]
    args += ["optimizer.clip_grad_norm=0"]
    args += [f"data.paths=[{pairs / 'pairs.jsonl'}]", f"finetune.tokenizer={pairs / 'tok.json'}"]
    args += ["data.seq_len=24", "data.hf.valid_documents=4", "trainer.global_batch_size=4", "trainer.max_steps=5"]
    return args + ["trainer.log_interval=1", "trainer.eval_interval=0", f"hydra.run.dir={run_dir}", *extra]


def _records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_ranks(pairs):
    """5 steps on 2 ranks, a checkpoint after step 3, the export at the end."""
    from conftest import run_main

    run = pairs / "two"
    out = run_main(_dpo(pairs, run, "checkpoint.interval=3", "checkpoint.export_safetensors=true"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def test_the_first_loss_is_ln2_with_metrics_named_as_trls_and_the_export_written(two_ranks):
    run, records = two_ranks
    first = records[0]
    assert first["step"] == 1 and abs(first["loss"] - math.log(2)) < 1e-6, first  # policy == reference
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logratios/chosen", "logratios/rejected"):
        assert first[name] == 0.0, (name, first)
    later = records[-1]
    assert later["step"] == 5 and later["loss"] != first["loss"]
    assert later["rewards/margins"] == pytest.approx(later["rewards/chosen"] - later["rewards/rejected"], abs=1e-6)
    assert 0.0 <= later["rewards/accuracies"] <= 1.0 and later["logps/chosen"] < 0
    assert (run / "checkpoints" / "export" / "model.safetensors").is_file()
    assert (run / "config.yaml").is_file()


VALIDATION = ["trainer.eval_interval=5", "trainer.eval_iters=1"]  # once, after the last step


@pytest.fixture(scope="module")
def one_rank(pairs):
    """5 steps on one process, the export at the end: the reference of the layouts."""
    from conftest import run_main

    run = pairs / "one_rank"
    extra = ["cluster.nproc_per_node=1", "checkpoint.export_safetensors=true", *VALIDATION]
    out = run_main(_dpo(pairs, run, *extra), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def _weights(run) -> dict:
    """The run's final weights: its export, else (a mixture of experts: no Hugging Face names) its
    last checkpoint's model."""
    import torch
    from safetensors.torch import load_file

    export = run / "checkpoints" / "export" / "model.safetensors"
    if export.is_file():
        return load_file(str(export))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))[-1]
    dcp_to_torch_save(str(final), str(run / "final.pt"))
    state = torch.load(run / "final.pt", weights_only=False)
    model = state["model"] if "model" in state else state
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def _equal_runs(ours, theirs, ours_dir=None, theirs_dir=None):
    """5 steps' numbers (and the exported weights, given the runs) within 1e-5: the same fp32 sums,
    reduced over ranks in another order (measured differences ~1e-7)."""
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5]
    for mine, other in zip(ours, theirs):
        assert mine["loss"] == pytest.approx(other["loss"], abs=1e-5), (mine, other)
        assert mine["rewards/margins"] == pytest.approx(other["rewards/margins"], abs=1e-5)
        assert mine["logps/chosen"] == pytest.approx(other["logps/chosen"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(other["grad_norm"], rel=1e-5)
        if "val_loss" in mine and "val_loss" in other:  # the validation pairs, split as training's
            for name in ("val_loss", "val_rewards/margins", "val_logps/chosen"):
                assert mine[name] == pytest.approx(other[name], abs=1e-5), (name, mine, other)
    if ours_dir is not None:
        mine, other = _weights(ours_dir), _weights(theirs_dir)
        assert mine.keys() == other.keys()
        for name in mine:
            assert (mine[name] - other[name]).abs().max() < 1e-5, name


def test_one_rank_equals_two_sharded_ranks(two_ranks, one_rank):
    _equal_runs(one_rank[1], two_ranks[1], one_rank[0], two_ranks[0])


LAYOUTS = {
    "tensor_parallel": ["parallelism.tp=2"],
    "torch_fsdp2": ["parallelism.engine=torch"],  # torch's fully_shard on the same 2 ranks
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_five_steps_equal_those_on_two_sharded_ranks(two_ranks, pairs, layout):
    from conftest import run_main

    extra = LAYOUTS[layout]
    run = pairs / layout
    out = run_main(_dpo(pairs, run, *extra), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    ours, sharded = _records(run), two_ranks[1]
    assert [r["step"] for r in ours] == [1, 2, 3, 4, 5]
    # 1e-5: the same fp32 sums, reduced over ranks in another order (measured differences ~1e-7).
    for mine, theirs in zip(ours, sharded):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), (mine, theirs)
        assert mine["rewards/margins"] == pytest.approx(theirs["rewards/margins"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)


def test_a_resume_after_three_of_five_steps_is_exact(two_ranks, pairs):
    from conftest import run_main

    run, straight = two_ranks
    resumed = pairs / "resumed"
    out = run_main(_dpo(pairs, resumed, f"checkpoint.resume={run / 'checkpoints' / 'step_00000003'}"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records] == [4, 5]
    for mine, theirs in zip(records, straight[3:]):
        for name in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert mine[name] == theirs[name], (name, mine, theirs)


# Context parallelism: each rank forwards a chunk of every sequence (the reference's too) and a
# reply's log-probability is the sum of the chunks' shares ([Note: sums over the chunks of a row]).
SPLIT = {
    "cp2": ["parallelism.cp=2"],  # 2 ranks, half of every sequence each
    "cp2_dp2": ["cluster.nproc_per_node=4", "parallelism.cp=2", "parallelism.dp_shard=2"],  # 4 ranks
}


@pytest.fixture(scope="module")
def context_parallel(pairs):
    """5 steps with cp=2 on 2 ranks, a checkpoint after step 3, the export at the end."""
    from conftest import run_main

    run = pairs / "cp2"
    extra = [*SPLIT["cp2"], "checkpoint.interval=3", "checkpoint.export_safetensors=true", *VALIDATION]
    out = run_main(_dpo(pairs, run, *extra), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


@pytest.mark.parametrize("layout", sorted(SPLIT))
def test_context_parallel_equals_one_process(one_rank, context_parallel, pairs, layout):
    from conftest import run_main

    if layout == "cp2":
        run, records = context_parallel
    else:
        run = pairs / layout
        out = run_main(_dpo(pairs, run, *SPLIT[layout], "checkpoint.export_safetensors=true", *VALIDATION), pairs)
        assert out.returncode == 0, out.stderr[-3000:]
        records = _records(run)
    assert "val_loss" in records[-1] and "val_loss" in one_rank[1][-1]
    _equal_runs(records, one_rank[1], run, one_rank[0])


def test_a_context_parallel_checkpoint_resumes_on_sharded_ranks_and_back(two_ranks, context_parallel, pairs):
    """cp=2's checkpoint after step 3 continues on dp_shard=2, and dp_shard=2's on cp=2: steps 4
    and 5 as the run that wrote it took them (1e-5: another layout's fp32 sums, as above)."""
    from conftest import run_main

    for (run, straight), extra in ((context_parallel, []), (two_ranks, SPLIT["cp2"])):
        resumed = pairs / f"{run.name}_resumed"
        step = run / "checkpoints" / "step_00000003"
        out = run_main(_dpo(pairs, resumed, f"checkpoint.resume={step}", *extra), pairs)
        assert out.returncode == 0, out.stderr[-3000:]
        records = _records(resumed)
        assert [r["step"] for r in records] == [4, 5]
        for mine, theirs in zip(records, straight[3:]):
            for name in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
                assert mine[name] == pytest.approx(theirs[name], abs=1e-5), (name, mine, theirs)


# Expert parallelism: a mixture-of-experts policy and its reference with their experts split over
# `ep` ranks. The balancing loss over the global batch (aux_loss_scope=global_batch) is the same
# on every layout; the per-micro-batch one changes with what each rank sees ([Note: global-batch
# load balancing] in framework/routing.py).
MOE = ["model=moe_debug", "model.args.aux_loss_scope=global_batch", "checkpoint.save_final=true"]
EXPERTS = {
    "ep2": ["parallelism.ep=2"],  # 2 ranks, 2 of the 4 experts each
    "ep2_dp4": ["cluster.nproc_per_node=4", "parallelism.ep=2"],  # 4 ranks: ep=2, each expert sharded over 2
}


@pytest.fixture(scope="module")
def moe_one_rank(pairs):
    from conftest import run_main

    run = pairs / "moe_one_rank"
    out = run_main(_dpo(pairs, run, *MOE, "cluster.nproc_per_node=1"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def test_a_mixture_of_experts_policy_adds_its_balancing_loss(moe_one_rank):
    first = moe_one_rank[1][0]
    # the policy is the reference (their DPO term ln 2, margins 0); the rest is the routers' aux loss
    assert first["rewards/margins"] == 0.0 and first["loss"] - math.log(2) > 1e-3, first


@pytest.mark.parametrize("layout", sorted(EXPERTS))
def test_expert_parallel_equals_one_process(moe_one_rank, pairs, layout):
    from conftest import run_main

    run = pairs / f"moe_{layout}"
    out = run_main(_dpo(pairs, run, *MOE, *EXPERTS[layout]), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    _equal_runs(_records(run), moe_one_rank[1], run, moe_one_rank[0])


def test_from_an_export_the_reference_is_the_imported_model(two_ranks, pairs):
    from conftest import run_main

    run, straight = two_ranks
    imported = pairs / "imported"
    export = run / "checkpoints" / "export"
    out = run_main(_dpo(pairs, imported, f"checkpoint.init_from={export}", "trainer.max_steps=2"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    first = _records(imported)[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6, first  # the reference holds the imported weights too
    assert abs(first["logps/chosen"] - straight[0]["logps/chosen"]) > 1e-3  # which are not the seeded ones


@pytest.fixture(scope="module")
def from_pretraining(pairs):
    """stage=dpo for 4 steps from a pre-training run's checkpoint (saved at its step 4, with another
    optimizer), a checkpoint after step 2; on 1 rank."""
    from conftest import pretraining_checkpoint, run_main

    start = pretraining_checkpoint(pairs, pairs / "tok.json")
    run = pairs / "from_pretraining"
    extra = [f"checkpoint.resume={start}", "checkpoint.interval=2", "cluster.nproc_per_node=1", "trainer.max_steps=4"]
    out = run_main(_dpo(pairs, run, *extra), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def test_from_a_pretraining_checkpoint_it_starts_at_step_0_with_those_weights_as_reference(two_ranks, from_pretraining):
    run, records = from_pretraining
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # its own schedule: not the pre-training's position
    first = records[0]
    assert abs(first["loss"] - math.log(2)) < 1e-6, first  # the reference is the policy: the loaded weights
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0, first
    assert first["lr"] == pytest.approx(0.05)  # optimizer=sgd's own learning rate, not the checkpoint's schedule
    # the policy is the pre-trained model, not the seeded initialisation (two_ranks' first step)
    assert abs(first["logps/chosen"] - two_ranks[1][0]["logps/chosen"]) > 1e-2, (first, two_ranks[1][0])


def test_a_resume_of_a_run_started_from_pretraining_continues_it_with_the_same_reference(pairs, from_pretraining):
    from conftest import run_main

    run, straight = from_pretraining
    resumed = pairs / "from_pretraining_resumed"
    extra = [f"checkpoint.resume={run / 'checkpoints' / 'step_00000002'}", "cluster.nproc_per_node=1"]
    out = run_main(_dpo(pairs, resumed, *extra, "trainer.max_steps=4"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records] == [3, 4]
    for mine, theirs in zip(records, straight[2:]):  # the rewards read the reference: the pre-trained model
        for name in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert mine[name] == theirs[name], (name, mine, theirs)


@pytest.fixture(scope="module")
def lora_from_pretraining(pairs):
    """stage=dpo with LoRA for 4 steps from the pre-training run's checkpoint (the frozen base),
    a checkpoint after step 2 (the adapters only); on 1 rank."""
    from conftest import pretraining_checkpoint, run_main

    start = pairs / "pretraining" / "checkpoints" / "step_00000004"
    if not start.is_dir():
        start = pretraining_checkpoint(pairs, pairs / "tok.json")
    run = pairs / "lora_from_pretraining"
    extra = [f"checkpoint.resume={start}", "checkpoint.interval=2", "cluster.nproc_per_node=1", "trainer.max_steps=4"]
    out = run_main(_dpo(pairs, run, "peft.lora.enabled=true", *extra), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def _resume_lora(pairs, step_dir, run_dir):
    from conftest import run_main

    extra = [f"checkpoint.resume={step_dir}", "cluster.nproc_per_node=1", "trainer.max_steps=4"]
    return run_main(_dpo(pairs, run_dir, "peft.lora.enabled=true", *extra), pairs)


def test_a_lora_resume_of_a_run_started_from_pretraining_reloads_its_frozen_base(pairs, lora_from_pretraining):
    run, straight = lora_from_pretraining
    resumed = pairs / "lora_from_pretraining_resumed"
    out = _resume_lora(pairs, run / "checkpoints" / "step_00000002", resumed)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records] == [3, 4]
    for mine, theirs in zip(records, straight[2:]):  # the base (and LoRA's reference) is the pre-trained model
        for name in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            assert mine[name] == theirs[name], (name, mine, theirs)


def test_a_moved_run_tree_resumes_and_a_missing_start_is_refused_naming_the_path(pairs, lora_from_pretraining):
    import shutil

    run, straight = lora_from_pretraining
    state = json.loads((run / "checkpoints" / "step_00000002" / "train_state.json").read_text())
    assert not state["start"].startswith("/"), state  # the sibling run's step directory, relative
    moved = pairs / "moved"
    shutil.copytree(pairs / "pretraining", moved / "pretraining")
    shutil.copytree(run, moved / run.name)
    away = pairs / "pretraining.away"
    (pairs / "pretraining").rename(away)  # the original tree is gone while the copy resumes
    try:
        out = _resume_lora(pairs, moved / run.name / "checkpoints" / "step_00000002", moved / "resumed")
        assert out.returncode == 0, out.stderr[-3000:]
        records = _records(moved / "resumed")
        assert [r["loss"] for r in records] == [r["loss"] for r in straight[2:]]
        shutil.rmtree(moved / "pretraining")
        out = _resume_lora(pairs, moved / run.name / "checkpoints" / "step_00000002", moved / "refused")
    finally:
        away.rename(pairs / "pretraining")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    looked = moved / "pretraining" / "checkpoints" / "step_00000004"
    assert f"{state['start']} (looked for {looked})" in errors[0] and "which is gone" in errors[0], errors
    assert "Traceback" not in out.stderr


def test_with_lora_the_reference_is_the_policy_without_its_adapters(pairs):
    from conftest import run_main

    run = pairs / "lora"
    out = run_main(_dpo(pairs, run, "peft.lora.enabled=true"), pairs)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(run)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6, records[0]  # B = 0: the adapted model is the base
    assert records[-1]["logratios/chosen"] != 0.0  # the adapters moved the policy away from the base


def test_bad_records_are_one_line_refusals(pairs):
    from conftest import run_main

    # every layout runs DPO (cp, ep: tests above; pipelines: tests/distributed/test_pipeline_dpo.py)
    bad = pairs / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
        + "\n"
        + json.dumps({"prompt": "a", "chosen": "b", "rejected": 3})
        + "\n"
    )
    args = [a.replace(str(pairs / "pairs.jsonl"), str(bad)) for a in _dpo(pairs, pairs / "bad")]
    out = run_main(args, pairs)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"error: {bad}: record 2: a preference record needs strings"), errors
    assert "Traceback" not in out.stderr and not (pairs / "bad" / "metrics.jsonl").exists()
