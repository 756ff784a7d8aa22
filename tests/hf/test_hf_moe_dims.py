"""transformers' mixture-of-experts families split by expert beside the other dimensions, each equal
to transformers on one process (framework/models/hf/moe.py; tests/hf/test_hf_moe_ep.py runs ep
alone and over dp_shard, with the exports).

On 4 gloo ranks, the trainer runs 5 steps of each layout below and a plain transformers model
trained on one process from the same initial weights on the same global batches gives the
reference (`_reference` of test_hf_moe_ep): the losses, the gradient norms and every weight after 5
steps agree within 1e-5 (fp32), the tolerance of test_hf_moe_ep and for its reasons (sums in
another order move fp32 results by ~1e-7 a step while the losses move by more than 0.1 over the 5
steps, asserted > 1e-3).

- hsdp: ep=2 x dp_replicate=2 x dp_shard=2 (strategy=hybrid): each replica splits the experts over
  its own 2 dp_shard ranks, the experts' gradients reduced within the replica and over the replicas;
- tp: ep=2 x tp=2 (dp_shard=2): attention and dense layers split by transformers' tp plan, the
  experts kept whole on every tp rank and split by expert over the dp_shard ranks of its tp index
  ([Note: experts under tensor parallelism]); the gradient norm counts each expert once
  (DeepSeek-V3: its plan splits the shared experts and dense blocks, not its MLA attention;
  gpt-oss ships no plan);
- tp_ep1: tp=2 x dp_shard=2 without expert parallelism: the experts whole on every tp rank,
  sharded with their block over dp_shard;
- pp: ep=2 x pp=2 (dp_shard=2, 1F1B, 2 microbatches): each stage's experts split over the 2
  dp_shard ranks of its pp index; gpt-oss's sliding-window layers get their own mask in a stage,
  as in the whole model; DeepSeek-V3 with 3 blocks cut [2, 1], so that each stage holds experts
  (its first block is dense). transformers' models add no load-balancing loss to ours (they
  add theirs only when given the labels), so no stage carries one;
- cp: ep=2 x cp=2 (dp_shard=2): each cp rank attends through the sequence exchange
  (framework/models/hf/context.py) and routes its chunk's tokens within its ep group, each expert
  sharded over the rank's efsdp x cp ranks. Mixtral and Qwen3-MoE (q/k norms) by default;
  DeepSeek-V3 (MLA: value heads narrower than query/key ones) and gpt-oss (attention sinks, a
  sliding window of 8 over chunks of 8) with COMPOSITION_ALL=1. Before context parallelism took
  these model types the job was refused by name.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.hf.test_hf_moe_ep import FAMILIES, STEPS, TOL, _reference
from tests.hf.test_hf_parity import make_config

ALL = os.environ.get("COMPOSITION_ALL") == "1"

LAYOUTS = {
    "hsdp": ({"strategy": "hybrid", "dp_replicate": 2, "dp_shard": 2, "ep": 2}, sorted(FAMILIES)),
    "tp": ({"dp_shard": 2, "tp": 2, "ep": 2}, ["deepseek_v3", "mixtral", "qwen3_moe"]),
    "tp_ep1": ({"dp_shard": 2, "tp": 2}, ["qwen3_moe"]),
    "pp": ({"dp_shard": 2, "pp": 2, "pp_schedule": "1f1b", "ep": 2}, sorted(FAMILIES)),
    # Mixtral and Qwen3-MoE by default; DeepSeek-V3 (MLA) and gpt-oss (sinks) with COMPOSITION_ALL=1
    "cp": ({"dp_shard": 2, "cp": 2, "ep": 2}, sorted(FAMILIES) if ALL else ["mixtral", "qwen3_moe"]),
}


def _rank(rank, world, run_dir, parallelism, labels):
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label in labels:
        config, extra = FAMILIES[label], {}
        if label == "deepseek_v3" and parallelism.get("pp", 1) > 1:
            # its first block is dense: 3 blocks cut [2, 1] give each stage one with experts
            config, extra = dict(config, num_hidden_layers=3), {"pp_split": [2, 1]}
        cfg = make_config(config, "causal_lm", {**parallelism, **extra}, f"{run_dir}/{label}")
        # the one-process reference on rank 0 only (the others wait in the job's first collective)
        reference, ref_losses, ref_norms = _reference(cfg) if rank == 0 else (None, None, None)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        steps = [trainer.train_step() for _ in range(STEPS)]
        ref_sd = reference.state_dict() if rank == 0 else None
        worst, held = 0.0, {}
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if ref_sd is not None:  # every rank gathers (a collective), rank 0 compares
                worst = max(worst, (whole - ref_sd[name]).abs().max().item())
            if ".mlp.experts." in name and hasattr(value, "device_mesh"):
                held[name] = (value.device_mesh.mesh_dim_names, tuple(value.to_local().shape))
        out[label] = {
            "losses": [s["loss"] for s in steps],
            "norms": [s["grad_norm"] for s in steps],
            "ref_losses": ref_losses,
            "ref_norms": ref_norms,
            "weights": worst,
            "held": held,
            "attention": getattr(getattr(trainer.model, "config", None), "_attn_implementation", None),
        }
        if trainer.ckpt is not None:
            trainer.ckpt.close()
        del trainer
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hf_moe_split_by_expert_beside_another_dimension_equals_transformers(tmp_path, layout):
    from tests.distributed.harness import run_ranks

    parallelism, labels = LAYOUTS[layout]
    results = run_ranks(_rank, world_size=4, args=(str(tmp_path), parallelism, labels), timeout_s=400)
    for label in labels:
        for rank in range(4):
            r, ref = results[rank][label], results[0][label]  # the reference ran on rank 0
            # every experts tensor this rank holds (its stages' under pp): 2 of the 4 experts, split on ep
            # (at ep=1 sharded with the block over dp_shard)
            split = parallelism.get("ep", 1) > 1
            assert r["held"] and all(("ep" in mesh) == split for mesh, _ in r["held"].values()), (label, r["held"])
            # (under cp each of the 2 sharded on dim 0 over the rank's efsdp x cp = 2 ranks: 1 row)
            rows = 2 // parallelism.get("cp", 1)
            assert all(shape[0] == rows for _, shape in r["held"].values()), (label, r["held"])
            if parallelism.get("cp", 1) > 1:  # the sequence exchange's attention, not a fallback
                assert r["attention"] == "framework_sequence_exchange", (label, r["attention"])
            assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"]), (label, r)
            assert max(abs(a - b) for a, b in zip(r["losses"], ref["ref_losses"])) <= TOL, (
                label,
                rank,
                r,
            )
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["ref_norms"])) <= TOL, (label, rank, r)
            assert r["weights"] <= TOL, (label, rank, r["weights"], r["losses"], ref["ref_losses"])
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, losses)  # it trains


def test_a_stage_without_experts_is_refused_by_name():
    """Under ep x pp every stage must hold a block with experts (its rank splits them with its ep
    group); one holding dense blocks only (DeepSeek-V3's first ones) is refused in one line naming
    the fix, before any collective."""
    from framework.config.schema import ModelConfig
    from framework.distributed.expert_parallel import apply_expert_parallel
    from framework.errors import UserInputError
    from framework.models.hf.model import build_hf
    from framework.models.hf.pipeline import pipeline_stage

    model = build_hf(ModelConfig(name="hf", config=FAMILIES["deepseek_v3"], task="causal_lm"))
    first = pipeline_stage(model, 0, 1, True, False)  # block 0: dense (first_k_dense_replace=1)
    with pytest.raises(UserInputError, match=r"parallelism.ep=2 with parallelism.pp=2: this rank's stages hold no"):
        apply_expert_parallel(first, 2, 1, "cpu", pp=2)
