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
  ([Note: experts under tensor parallelism]); the gradient norm counts each expert once;
- tp_ep1: tp=2 x dp_shard=2 without expert parallelism: the experts whole on every tp rank,
  sharded with their block over dp_shard.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.hf.test_hf_moe_ep import FAMILIES, STEPS, TOL, _reference
from tests.hf.test_hf_parity import make_config

LAYOUTS = {
    "hsdp": ({"strategy": "hybrid", "dp_replicate": 2, "dp_shard": 2, "ep": 2}, sorted(FAMILIES)),
    "tp": ({"dp_shard": 2, "tp": 2, "ep": 2}, ["mixtral", "qwen3_moe"]),
    "tp_ep1": ({"dp_shard": 2, "tp": 2}, ["qwen3_moe"]),
}


def _rank(rank, world, run_dir, parallelism, labels):
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label in labels:
        cfg = make_config(FAMILIES[label], "causal_lm", parallelism, f"{run_dir}/{label}")
        reference, ref_losses, ref_norms = _reference(cfg)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        steps = [trainer.train_step() for _ in range(STEPS)]
        ref_sd = reference.state_dict()
        worst, held = 0.0, {}
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
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
            r = results[rank][label]
            # every experts tensor this rank holds (its stages' under pp): 2 of the 4 experts, split on ep
            # (at ep=1 sharded with the block over dp_shard)
            split = parallelism.get("ep", 1) > 1
            assert r["held"] and all(("ep" in mesh) == split for mesh, _ in r["held"].values()), (label, r["held"])
            assert all(shape[0] == 2 for _, shape in r["held"].values()), (label, r["held"])
            assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"]), (label, r)
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= TOL, (label, rank, r)
            assert max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"])) <= TOL, (label, rank, r)
            assert r["weights"] <= TOL, (label, rank, r["weights"])
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, losses)  # it trains
