"""stage=grpo through main.py: 1 rank, tensor parallelism and torch's FSDP2 equal 2 ranks sharded by
our engine, a resume is exact (the rollouts included), refusals of bad prompt files and reward code
(the objective against TRL and the rewards in one process: tests/finetune/test_grpo_loss.py)."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """A tokenizer.json and a JSONL file of 100 one-digit sums with their answers (4 held out)."""
    from framework.data.tokenizer import EOD, train_bpe

    root = tmp_path_factory.mktemp("grpo")
    texts = [f"Q: {i}+{j}= A: {i + j}{EOD}" for i in range(10) for j in range(10)]
    train_bpe(texts, 300, str(root / "tok.json"))
    with open(root / "sums.jsonl", "w") as f:
        for i in range(10):
            for j in range(10):
                f.write(json.dumps({"prompt": f"Q: {i}+{j}= A:", "answer": i + j}) + "\n")
    return root


def _grpo(prompts, run_dir, *extra):
    from conftest import TINY

    # SGD with momentum, unclipped: a gradient of the wrong scale shows in the next steps' numbers.
    # The format reward (a digit anywhere) varies between a group's completions from the first step,
    # so the advantages (and the gradients) are not all 0; two iterations and beta > 0 use every term.
    args = [a for a in TINY if not a.startswith("data=")] + ["data=hf", "stage=grpo", "optimizer=sgd"]
    args += ["optimizer.clip_grad_norm=0", "optimizer.lr=0.05"]
    args += [f"data.paths=[{prompts / 'sums.jsonl'}]", f"finetune.tokenizer={prompts / 'tok.json'}"]
    args += ["data.seq_len=32", "data.hf.valid_documents=4", "trainer.global_batch_size=4", "trainer.max_steps=4"]
    args += ["grpo.num_generations=4", "grpo.max_new_tokens=6", "grpo.beta=0.1"]
    args += ["grpo.rewards=[exact_match,format]", "grpo.format_regex='[0-9]'", "grpo.iterations=2"]
    return args + ["trainer.log_interval=1", "trainer.eval_interval=0", f"hydra.run.dir={run_dir}", *extra]


def _records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_error(out) -> str:
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def two_ranks(prompts):
    """4 steps on 2 ranks, a checkpoint after step 2."""
    from conftest import run_main

    run = prompts / "two"
    out = run_main(_grpo(prompts, run, "checkpoint.interval=2"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def test_metrics_of_the_rollouts(two_ranks):
    _, records = two_ranks
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert 0 <= r["reward"] <= 2 and r["reward_std"] >= 0 and 1 <= r["completion_length"] <= 6
        assert 0 <= r["clip_fraction"] <= 1 and r["kl"] >= 0
        assert r["reward"] == pytest.approx(r["rewards/exact_match"] + r["rewards/format"], abs=1e-9)
    assert records[0]["kl"] == 0.0  # the policy is the reference before its first update
    assert records[0]["reward_std"] > 0 and records[0]["grad_norm"] > 0  # advantages that are not 0
    assert records[-1]["kl"] > 0
    # The second iteration's ratios are to the rollout policy's log-probabilities, taken once before
    # the first: the update between them moves some past 1 +- epsilon (recomputing them would clip none).
    assert any(r["clip_fraction"] > 0 for r in records)


LAYOUTS = {
    "one_rank": ["cluster.nproc_per_node=1"],
    "accumulation": ["cluster.nproc_per_node=1", "trainer.micro_batch_size=1"],  # 4 micro-batches of 1 prompt
    "tensor_parallel": ["parallelism.tp=2"],
    "torch_fsdp2": ["parallelism.engine=torch"],  # torch's fully_shard on the same 2 ranks
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_one_rank_and_tensor_parallel_equal_two_sharded_ranks(two_ranks, prompts, layout, request):
    from conftest import run_main

    run = prompts / layout
    if layout == "one_rank":  # the module's one-process run
        run = request.getfixturevalue("one_rank")[0]
    else:
        out = run_main(_grpo(prompts, run, *LAYOUTS[layout]), prompts)
        assert out.returncode == 0, out.stderr[-3000:]
    # The same completions (seeded per prompt, not per rank), so the same rewards exactly; the losses
    # to 1e-5: the same fp32 sums reduced over ranks in another order.
    for mine, theirs in zip(_records(run), two_ranks[1], strict=True):
        assert mine["reward"] == theirs["reward"] and mine["completion_length"] == theirs["completion_length"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["kl"] == pytest.approx(theirs["kl"], abs=1e-6)


# Context parallelism: each rank forwards a chunk of every rollout (the reference's and the
# rollout policy's passes too), the chunks' log-probabilities gathered whole on every cp rank
# ([Note: sums over the chunks of a row]); generation runs whole sequences as without it.
SPLIT = {
    "cp2": ["parallelism.cp=2"],  # 2 ranks, half of every sequence each
    "cp2_dp2": ["cluster.nproc_per_node=4", "parallelism.cp=2", "parallelism.dp_shard=2"],  # 4 ranks
}


@pytest.fixture(scope="module")
def one_rank(prompts):
    """4 steps on one process, the export at the end."""
    from conftest import run_main

    run = prompts / "one_rank"
    out = run_main(_grpo(prompts, run, "cluster.nproc_per_node=1", "checkpoint.export_safetensors=true"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


@pytest.mark.parametrize("layout", sorted(SPLIT))
def test_context_parallel_equals_one_process(one_rank, prompts, layout):
    from conftest import run_main
    from safetensors.torch import load_file

    run = prompts / layout
    out = run_main(_grpo(prompts, run, *SPLIT[layout], "checkpoint.export_safetensors=true"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    # The same completions, so the same rewards exactly; the rest to 1e-5: the same fp32 sums,
    # reduced over ranks and chunks in another order (measured differences ~1e-8).
    for mine, theirs in zip(_records(run), one_rank[1], strict=True):
        assert mine["reward"] == theirs["reward"] and mine["completion_length"] == theirs["completion_length"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["kl"] == pytest.approx(theirs["kl"], abs=1e-6)
        assert mine["clip_fraction"] == pytest.approx(theirs["clip_fraction"], abs=1e-6)
    weights = [load_file(str(r / "checkpoints" / "export" / "model.safetensors")) for r in (run, one_rank[0])]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert (value - weights[1][name]).abs().max() < 1e-5, name


def test_a_resume_after_two_of_four_steps_is_exact(two_ranks, prompts):
    from conftest import run_main

    run, straight = two_ranks
    resumed = prompts / "resumed"
    out = run_main(_grpo(prompts, resumed, f"checkpoint.resume={run / 'checkpoints' / 'step_00000002'}"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records] == [3, 4]
    for mine, theirs in zip(records, straight[2:]):
        for name in ("loss", "reward", "reward_std", "kl", "completion_length", "grad_norm"):
            assert mine[name] == theirs[name], (name, mine, theirs)


def test_a_resume_with_other_objective_settings_is_refused_naming_the_saved_ones(two_ranks, prompts):
    """The checkpoint was trained with grpo.beta=0.1 and loss_type dapo: a resume at beta 0 (the
    default) with loss_type grpo would switch objective mid-run."""
    from conftest import run_main

    run, _ = two_ranks
    step = run / "checkpoints" / "step_00000002"
    args = [a for a in _grpo(prompts, prompts / "switched", f"checkpoint.resume={step}") if a != "grpo.beta=0.1"]
    error = _one_error(run_main(args + ["grpo.loss_type=grpo", "cluster.nproc_per_node=1"], prompts))
    assert error.startswith(
        f"error: checkpoint.resume: {step} was trained with grpo.loss_type=dapo grpo.beta=0.1 (this job: grpo, 0.0;"
    ), error
    assert not (prompts / "switched" / "checkpoints" / "step_00000003").exists()


@pytest.fixture(scope="module")
def from_pretraining(prompts):
    """stage=grpo for 4 steps from a pre-training run's checkpoint (saved at its step 4), a checkpoint
    after step 2; on 1 rank."""
    from conftest import pretraining_checkpoint, run_main

    start = pretraining_checkpoint(prompts, prompts / "tok.json")
    run = prompts / "from_pretraining"
    extra = [f"checkpoint.resume={start}", "checkpoint.interval=2", "cluster.nproc_per_node=1"]
    out = run_main(_grpo(prompts, run, *extra), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"initialised the model from {start} (saved by stage=training at step 4)" in out.stderr, out.stderr[-3000:]
    return run, _records(run)


def test_from_a_pretraining_checkpoint_it_starts_at_step_0_with_those_weights_as_reference(from_pretraining):
    _, records = from_pretraining
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # its own schedule: not the pre-training's position
    assert records[0]["kl"] == 0.0  # the reference is the loaded model, the policy before its first update
    assert records[0]["lr"] == pytest.approx(0.05)  # this job's optimizer.lr, not the checkpoint's schedule
    assert records[-1]["kl"] > 0


def test_a_resume_of_a_run_started_from_pretraining_continues_it_with_the_same_reference(prompts, from_pretraining):
    from conftest import run_main

    run, straight = from_pretraining
    resumed = prompts / "from_pretraining_resumed"
    extra = [f"checkpoint.resume={run / 'checkpoints' / 'step_00000002'}", "cluster.nproc_per_node=1"]
    out = run_main(_grpo(prompts, resumed, *extra), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(resumed)
    assert [r["step"] for r in records] == [3, 4]
    for mine, theirs in zip(records, straight[2:]):  # kl reads the reference: the pre-trained model
        for name in ("loss", "reward", "kl", "completion_length", "grad_norm"):
            assert mine[name] == theirs[name], (name, mine, theirs)


def test_with_lora_the_reference_is_the_policy_without_its_adapters(prompts):
    from conftest import run_main

    run = prompts / "lora"
    out = run_main(_grpo(prompts, run, "peft.lora.enabled=true", "trainer.max_steps=3"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    records = _records(run)
    assert records[0]["kl"] == 0.0  # B = 0: the adapted model is the base
    assert records[-1]["kl"] > 0  # the adapters moved the policy away from the base


def test_a_bad_prompt_file_is_refused_in_one_line_with_nothing_written(prompts):
    from conftest import run_main

    bad = prompts / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Q: 1+1= A:", "answer": 2}) + "\n" + json.dumps({"answer": 3}) + "\n")
    run = prompts / "bad"
    args = [a.replace(str(prompts / "sums.jsonl"), str(bad)) for a in _grpo(prompts, run)]
    error = _one_error(run_main(args, prompts))
    assert error.startswith(f"error: {bad}: record 2: 'prompt' must be a non-empty string or chat turns"), error
    assert not (run / "metrics.jsonl").exists() and not (run / "config.yaml").exists()


def test_reward_code_runs_only_when_trusted_and_a_raising_one_ends_the_job_with_its_traceback(prompts):
    from conftest import run_main

    module = (prompts / "user_rewards").with_suffix(".py")
    marker = prompts / "imported"
    module.write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('imported')\n"
        "def broken(completions, **kwargs):\n"
        "    raise RuntimeError('no score for ' + repr(completions[0][:0]))\n"
    )
    run = prompts / "untrusted"
    error = _one_error(run_main(_grpo(prompts, run, f"grpo.reward_module={module}:broken"), prompts))
    assert error == (
        f"error: grpo.reward_module='{module}:broken' runs your own code in every rank: set "
        "grpo.trust_reward_code=true to allow it"
    )
    assert not marker.exists() and not run.exists()  # never imported, no run directory
    run = prompts / "raising"
    out = run_main(_grpo(prompts, run, f"grpo.reward_module={module}:broken", "grpo.trust_reward_code=true"), prompts)
    # the user's code failing, not bad input: status 1 and its traceback, through its own line
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" in out.stderr and f'File "{module}", line 4, in broken' in out.stderr, out.stderr[-3000:]
    assert "RuntimeError: no score for ''" in out.stderr, out.stderr[-3000:]
    assert marker.exists()  # trusted: imported
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").read_text().strip()


def test_a_reward_function_written_for_trl_runs_unchanged(prompts):
    """A function in TRL's form (completions and the dataset's columns as keyword arguments) scores
    the completions: its reward is the exact-match reward, computed by the function itself."""
    from conftest import run_main

    module = (prompts / "trl_rewards").with_suffix(".py")
    module.write_text(
        "import re\n"
        "def correct(completions, answer, **kwargs):\n"
        "    assert len(kwargs['prompts']) == len(completions) == len(kwargs['completion_ids'])\n"
        "    found = [re.search(r'(-?\\d+)', c) for c in completions]\n"
        "    return [float(f is not None and f.group(1) == str(a)) for f, a in zip(found, answer)]\n"
    )
    run = prompts / "trl_reward"
    extra = [f"grpo.reward_module={module}:correct", "grpo.trust_reward_code=true", "cluster.nproc_per_node=1"]
    args = [a for a in _grpo(prompts, run, *extra, "trainer.max_steps=2") if not a.startswith("grpo.beta=")]
    out = run_main(args, prompts)  # TRL's defaults: beta 0 (no reference model, no kl), loss_type dapo
    assert out.returncode == 0, out.stderr[-3000:]
    for r in _records(run):  # the same score as the built-in exact_match on the same completions
        assert "kl" not in r and r["grad_norm"] > 0, r
        assert r["rewards/user"] == r["rewards/exact_match"], r
        assert r["reward"] == pytest.approx(r["rewards/exact_match"] * 2 + r["rewards/format"], abs=1e-9)


def test_a_reward_function_of_the_earlier_form_is_refused_and_one_returning_none_runs(prompts):
    """fn(prompts, completions, answers) is refused in one line before training (status 2); a TRL
    function that returns None for some completions (not applicable) is left out of those sums."""
    from conftest import run_main

    module = (prompts / "forms").with_suffix(".py")
    module.write_text(
        "def old(prompts, completions, answers):\n"
        "    return [0.0] * len(completions)\n"
        "def sometimes(completions, **kwargs):\n"
        "    return [None if i % 2 else 1.0 for i in range(len(completions))]\n"
    )
    run = prompts / "old_form"
    extra = ["grpo.trust_reward_code=true", "cluster.nproc_per_node=1", "trainer.max_steps=2"]
    error = _one_error(run_main(_grpo(prompts, run, f"grpo.reward_module={module}:old", *extra), prompts))
    named = f"error: grpo.reward_module='{module}:old': old(prompts, completions, answers) cannot be called"
    assert error.startswith(named), error
    assert "fn(prompts, completions, completion_ids, **kwargs)" in error, error
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    run = prompts / "none_reward"
    out = run_main(_grpo(prompts, run, f"grpo.reward_module={module}:sometimes", *extra), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    for r in _records(run):  # the user's mean over the completions it scored: each 1.0
        assert r["rewards/user"] == 1.0 and r["grad_norm"] > 0, r
        # every completion is scored by the built-ins: the reward mean counts the user's 1.0 on half
        assert r["reward"] == pytest.approx(r["rewards/exact_match"] + r["rewards/format"] + 0.5, abs=1e-9), r


# Expert parallelism: a mixture-of-experts policy (and its reference) with the experts split over
# `ep` ranks; generation runs in lockstep, each forward's all-to-all on every rank of the group
# ([Note: generation with experts split] in framework/generation/__init__.py). The balancing loss
# over the global batch (aux_loss_scope=global_batch, its routing pass ahead) is the same on every
# layout ([Note: global-batch load balancing] in framework/routing.py).
MOE = ["model=moe_debug", "model.args.aux_loss_scope=global_batch", "checkpoint.save_final=true"]
# one held-out prompt, completed at step 5: only rank 0 has one, the other ranks step with it
MOE += ["data.hf.valid_documents=1", "trainer.eval_interval=5"]
EXPERTS = {"ep2": ["parallelism.ep=2"]}  # 2 ranks, 2 of the 4 experts each
if os.environ.get("COMPOSITION_ALL") == "1":
    # 4 ranks: ep=2 x dp_shard=2, each expert sharded over 2 ranks
    EXPERTS["ep2_dp4"] = ["cluster.nproc_per_node=4", "parallelism.ep=2"]


@pytest.fixture(scope="module")
def moe_one_rank(prompts):
    """5 steps of a mixture-of-experts policy on one process, the export at the end."""
    from conftest import run_main

    run = prompts / "moe_one_rank"
    out = run_main(_grpo(prompts, run, *MOE, "trainer.max_steps=5", "cluster.nproc_per_node=1"), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    return run, _records(run)


def test_a_mixture_of_experts_policy_adds_its_balancing_loss(moe_one_rank):
    first = moe_one_rank[1][0]
    # Before the first update the clipped term is 0 (ratios 1, advantages summing to 0 in each
    # group) and so is the KL (the policy is the reference): the loss is the routers' aux loss.
    assert first["kl"] == 0.0 and first["loss"] > 1e-3, first
    assert "moe_load_l0" in first, first  # the routers count the rollouts' micro-batches


@pytest.mark.parametrize("layout", sorted(EXPERTS))
def test_expert_parallel_equals_one_process(moe_one_rank, prompts, layout):
    from conftest import run_main

    run = prompts / f"moe_{layout}"
    out = run_main(_grpo(prompts, run, *MOE, "trainer.max_steps=5", *EXPERTS[layout]), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    # The same completions (each expert's rows computed on its rank), so the same rewards exactly;
    # the rest to 1e-5: the same fp32 sums reduced over ranks in another order.
    for mine, theirs in zip(_records(run), moe_one_rank[1], strict=True):
        assert mine["reward"] == theirs["reward"] and mine["completion_length"] == theirs["completion_length"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5), (mine, theirs)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["kl"] == pytest.approx(theirs["kl"], abs=1e-5)
        assert mine["moe_load_l0"] == theirs["moe_load_l0"]
        assert mine.get("val_reward") == theirs.get("val_reward")
    assert "val_reward" in mine
    mine, theirs = _final_weights(run), _final_weights(moe_one_rank[0])
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert (value - theirs[name]).abs().max() < 1e-5, name


def _final_weights(run) -> dict:
    """The model of the run's last checkpoint (a mixture of experts has no Hugging Face export)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    final = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))[-1]
    dcp_to_torch_save(str(final), str(run / "final.pt"))
    state = torch.load(run / "final.pt", weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


# Pipeline stages ([Note: GRPO through a pipeline] in framework/grpo/pipeline.py): the rollouts
# decoded through the stages in turn, the log-probabilities and the loss through the schedule. 1f1b
# by default; with COMPOSITION_ALL=1 also gpipe with 2 microbatches of 2 prompts (one process runs 4
# micro-batches of 1: dapo's divisor follows the microbatches) and pp=2 x dp_shard=2 on 4 ranks (each
# data-parallel rank decodes its own prompts, in step with the other's: the stages' forwards gather
# over both).
PIPELINES = {"pp2_1f1b": ["parallelism.pp=2", "parallelism.pp_schedule=1f1b"]}
if os.environ.get("COMPOSITION_ALL") == "1":
    PIPELINES["pp2_gpipe"] = ["parallelism.pp=2", "parallelism.pp_schedule=gpipe", "parallelism.pp_microbatches=2"]
    PIPELINES["pp2_dp2"] = ["cluster.nproc_per_node=4", "parallelism.pp=2", "parallelism.dp_shard=2"]


@pytest.mark.parametrize("layout", sorted(PIPELINES))
def test_pipeline_stages_equal_one_process(one_rank, prompts, layout):
    from conftest import run_main
    from safetensors.torch import load_file

    run = prompts / layout
    extra = [*PIPELINES[layout], "trainer.micro_batch_size=1", "checkpoint.export_safetensors=true"]
    out = run_main(_grpo(prompts, run, *extra), prompts)
    assert out.returncode == 0, out.stderr[-3000:]
    # The same completions (decoded through the stages without a cache: the same tokens), so the
    # same rewards exactly; the rest to 1e-5: the same fp32 operations on rows padded at the end,
    # the gradient norm summed per stage then over the stages.
    for mine, theirs in zip(_records(run), one_rank[1], strict=True):
        assert mine["reward"] == theirs["reward"] and mine["completion_length"] == theirs["completion_length"]
        assert mine["reward_std"] == theirs["reward_std"]
        for name in ("loss", "grad_norm", "kl", "clip_fraction"):
            assert mine[name] == pytest.approx(theirs[name], abs=1e-5), (name, mine, theirs)
    weights = [load_file(str(r / "checkpoints" / "export" / "model.safetensors")) for r in (run, one_rank[0])]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert (value - weights[1][name]).abs().max() < 1e-5, name


def test_a_pipeline_refuses_rows_longer_than_its_stages_shape_in_one_line(prompts):
    """The stages take rows of data.seq_len tokens: a prompt plus grpo.max_new_tokens longer is
    refused before the first step, naming both settings."""
    from conftest import run_main

    run = prompts / "pp_short"
    error = _one_error(
        run_main(_grpo(prompts, run, "parallelism.pp=2", "trainer.micro_batch_size=1", "data.seq_len=8"), prompts)
    )
    assert error.startswith("error: stage=grpo with parallelism.pp=2: a prompt of "), error
    assert "longer than the pipeline's data.seq_len=8" in error and "grpo.max_new_tokens=6" in error, error
    assert not (run / "checkpoints").exists()
