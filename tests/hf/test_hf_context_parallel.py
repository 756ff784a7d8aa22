"""Context parallelism for Hugging Face models ([Note: context parallelism inside a transformers
model] in framework/models/hf/context.py): transformers' Llama, Qwen2 and Mistral split over the
sequence train as one process does.

For each family, the trainer at cp=2 (2 ranks) and at dp_shard=2 x cp=2 (4 ranks), and for Llama and
Mistral at tp=2 x cp=2 (4 ranks: transformers' tp plan, then cp over each tp rank's heads), runs 5
steps of SGD with momentum; its losses, gradient norms and weights after the 5 steps are compared with a
plain transformers model trained on one process from the same initial weights on the same global
batches. Qwen2 has one KV head (cp does not divide it: the KV heads travel repeated) and Mistral a
sliding window of 5 tokens over rows of 16 (so each chunk of 8 attends across the chunk boundary
through the window). Tolerance 1e-5 (fp32): the split run sums attention's inputs, the loss and
the gradients in another order (all-to-all, reduce-scatter over 2 or 4 ranks, 2 micro-steps),
which moves fp32 results by ~1e-7 per step; a chunk numbered from 0 (the positions hook turned
off, tried once) fails from the first step. dp_shard=2 x cp=2 runs by default; cp=2 alone and
tp=2 x cp=2 with COMPOSITION_ALL=1.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from tests.hf.test_hf_parity import LLAMA, make_config

FAMILIES = {
    "llama": LLAMA,
    "qwen2": dict(LLAMA, model_type="qwen2", num_key_value_heads=1),
    "mistral": dict(LLAMA, model_type="mistral", sliding_window=5),
}
TOL = 1e-5  # see the module docstring
STEPS = 5


def _reference(cfg):
    """The trainer's model build and data, trained by plain transformers on one process: (losses,
    gradient norms, weights after the steps)."""
    from framework.models import family_of
    from tests.hf.one_process import train_steps, whole_batch_data

    family = family_of(cfg.model)
    task = family.task(cfg.model)
    torch.manual_seed(cfg.trainer.seed)  # the trainer's sequence: seed, a meta build, the real build
    family.build(cfg.model, "meta")
    model = family.build(cfg.model, "cpu")
    family.init_weights(model, cfg.trainer.seed)
    losses, norms = train_steps(model, task, whole_batch_data(cfg, family, task), cfg, STEPS)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


LAYOUTS = {  # name: (ranks, parallelism, families)
    "cp2": (2, {"cp": 2, "dp_shard": 1}, tuple(FAMILIES)),
    "dp_shard2_x_cp2": (4, {"cp": 2, "dp_shard": 2}, tuple(FAMILIES)),
    # tp splits the heads first, cp the heads of each tp rank (Qwen2's one KV head: tp cannot split it)
    "tp2_x_cp2": (4, {"cp": 2, "tp": 2, "dp_shard": 1}, ("llama", "mistral")),
}


def _split_rank(rank, world, run_dir, parallelism, families):
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label in families:
        cfg = make_config(FAMILIES[label], "causal_lm", parallelism, run_dir, steps=STEPS)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        steps = [trainer.train_step() for _ in range(STEPS)]
        weights = {}
        for name, value in trainer.model.state_dict().items():
            weights[name] = value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()
        out[label] = {
            "losses": [s["loss"] for s in steps],
            "norms": [s["grad_norm"] for s in steps],
            "weights": weights if rank == 0 else None,
            "implementation": trainer.model.config._attn_implementation,
            "degrees": {"cp": trainer.dims.cp, "tp": trainer.dims.tp, "dp_shard": trainer.dims.dp_shard},
        }
        del trainer
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("reference"))
    return {label: _reference(make_config(c, "causal_lm", {}, run_dir, steps=STEPS)) for label, c in FAMILIES.items()}


# dp_shard=2 x cp=2 (the split beside sharding) in every run; cp=2 alone and tp=2 x cp=2 with
# COMPOSITION_ALL=1 (the suite's time on CI's 2 cores)
_BY_DEFAULT = ("dp_shard2_x_cp2",)
_OPT_IN = pytest.mark.skipif(
    os.environ.get("COMPOSITION_ALL") != "1", reason="another layout of the same split: COMPOSITION_ALL=1 runs it"
)


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=() if name in _BY_DEFAULT else _OPT_IN) for name in LAYOUTS]
)
def test_hf_families_split_over_the_sequence_equal_one_process(layout, references, tmp_path):
    from tests.distributed.harness import run_ranks

    world, parallelism, families = LAYOUTS[layout]
    results = run_ranks(_split_rank, world, args=(str(tmp_path), parallelism, families), timeout_s=300)
    for label in families:
        ref_losses, ref_norms, ref_weights = references[label]
        for rank, res in enumerate(results):
            got = res[label]
            assert got["implementation"] == "framework_sequence_exchange", (label, got["implementation"])
            assert got["degrees"] == {"tp": 1, **parallelism}, got["degrees"]
            assert all(math.isfinite(x) for x in got["losses"]), (label, got)
            assert got["losses"] == pytest.approx(ref_losses, abs=TOL), (label, rank, got["losses"], ref_losses)
            assert got["norms"] == pytest.approx(ref_norms, abs=TOL), (label, rank, got["norms"], ref_norms)
        weights = results[0][label]["weights"]
        assert set(weights) == set(ref_weights), label
        worst = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
        assert worst <= TOL, (label, worst)
        assert max(ref_losses) - min(ref_losses) > 1e-3, (label, ref_losses)  # the model trains


def test_a_cp2_checkpoint_resumes_on_dp_shard2_with_the_same_losses(tmp_path):
    """main.py with a transformers Llama: 3 steps at cp=2 (2 ranks) saving a checkpoint, resumed at
    dp_shard=2 (2 ranks, whole sequences) for steps 4-5. The losses and gradient norms of all 5 steps
    equal the uninterrupted one-process job's (1e-5, as above: sums in another order)."""
    from conftest import TINY, read_metrics, run_main

    inline = ",".join(f"{k}: {v}" for k, v in LLAMA.items())
    args = [*TINY, "model=hf", f"+model.config={{{inline}}}", "data.seq_len=32", "trainer.global_batch_size=4"]
    args += ["trainer.micro_batch_size=1", "trainer.eval_interval=0", "trainer.log_interval=1", "optimizer=sgd"]
    one, split = tmp_path / "one", tmp_path / "split"
    jobs = [
        (one, ["trainer.max_steps=5", "cluster.nproc_per_node=1"]),
        (split, ["trainer.max_steps=3", "parallelism.cp=2", "cluster.nproc_per_node=2", "checkpoint.save_final=true"]),
        (
            split,
            ["trainer.max_steps=5", "parallelism.dp_shard=2", "cluster.nproc_per_node=2", "checkpoint.resume=auto"],
        ),
    ]
    for run, extra in jobs:
        out = run_main([*args, *extra, f"hydra.run.dir={run}"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        if "parallelism.cp=2" in extra:
            assert " cp=2," in out.stderr, out.stderr[-2000:]
    assert "resumed from" in out.stdout + out.stderr, out.stderr[-2000:]
    want, got = read_metrics(one), read_metrics(split)
    assert [r["step"] for r in got if "loss" in r] == [1, 2, 3, 4, 5], got
    for key in ("loss", "grad_norm"):
        mine = [r[key] for r in got if "loss" in r]
        assert mine == pytest.approx([r[key] for r in want if "loss" in r], abs=TOL), key
    assert max(r["loss"] for r in want) - min(r["loss"] for r in want) > 1e-3  # the model trains


def test_outside_the_split_the_model_computes_as_sdpa_and_a_padding_mask_is_not_split():
    """A model readied for cp computes, outside the exchange (sampling, whole-sequence evaluation),
    as transformers' sdpa does: the same logits, with a left-padding mask and a sliding window too
    (bit for bit: the same kernel on the same inputs). Under the exchange a padding mask is refused:
    the chunk's mask would be dropped. A cp that does not divide the heads is refused by name."""
    from types import SimpleNamespace

    from framework.config.schema import ModelConfig
    from framework.errors import UserInputError
    from framework.models.hf.context import prepare_context_parallel
    from framework.models.hf.model import build_hf

    cfg = ModelConfig(name="hf", config=dict(FAMILIES["mistral"]))
    torch.manual_seed(0)
    plain = build_hf(cfg)
    ready = copy.deepcopy(plain)
    prepare_context_parallel(ready, 2)
    assert plain.config._attn_implementation == "sdpa" != ready.config._attn_implementation
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(ready(ids, **kwargs).logits, plain(ids, **kwargs).logits), kwargs
    ready._framework_sequence_exchange = SimpleNamespace(active=True, group=None, size=2, rank=1)
    with pytest.raises(ValueError, match="padding"):
        ready(ids, attention_mask=mask)
    # heads the job's config did not state (the class's default) are checked at the build, by name
    with pytest.raises(UserInputError, match="parallelism.cp=3 does not divide the 4 attention heads"):
        prepare_context_parallel(copy.deepcopy(plain), 3)


def test_outside_the_split_gpt_oss_keeps_its_attention_sinks():
    """gpt-oss readied for cp computes, outside the exchange, as transformers' own gpt-oss attention
    (its sinks join each row's softmax: sdpa would drop them): the same logits with and without a
    left-padding mask, on its full and sliding-window layers. 1e-5: the sink attention masks by
    filling where transformers adds the mask, and sums in another order."""
    from framework.config.schema import ModelConfig
    from framework.models.hf.context import prepare_context_parallel
    from framework.models.hf.model import build_hf
    from tests.hf.test_hf_moe_ep import FAMILIES as MOE

    cfg = ModelConfig(name="hf", config=dict(MOE["gpt_oss"], sliding_window=4))
    torch.manual_seed(0)
    plain = build_hf(cfg)
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.sinks.normal_(0, 2)  # sinks that matter
    ready = copy.deepcopy(plain)
    prepare_context_parallel(ready, 2)
    assert ready.config._attn_implementation == "framework_sequence_exchange"
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            got, want = ready(ids, **kwargs).logits, plain(ids, **kwargs).logits
            rows = slice(None) if not kwargs else (slice(None), slice(3, None))  # padded queries: unspecified
            assert (got[rows] - want[rows]).abs().max().item() < 1e-5, kwargs
