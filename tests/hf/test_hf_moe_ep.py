"""transformers' mixture-of-experts families split by expert (`parallelism.ep`, framework/models/hf/moe.py)
equal transformers on one process, and their exports load back into transformers.

For each family (tiny configs built here, nothing downloaded), the trainer runs 5 steps with ep=2
(2 ranks: each holds half the experts of every block) and with ep=2 x dp_shard=2 (4 ranks: each
expert sharded over 2 ranks besides), and a plain transformers model trained on one process from the
same initial weights on the same global batches gives the reference: the losses, the gradient
norms and every weight after 5 steps agree within 1e-5 (fp32). The sharded run sums the gradient in
another order (2 micro-batches per rank, the all-to-all's and reduce-scatter's sums) and the experts
multiply rows batched otherwise; that moves fp32 results by ~1e-7 a step, and 1e-5 leaves room for
5 steps of it and nothing more: an expert computed on another rank's weights, a lost row, or an
expert gradient scaled by 1/ep moves the loss by more than 1e-3. Every export (written by the ep
job) loads in transformers with no missing or unexpected key and holds the job's weights.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.hf.test_hf_parity import make_config

BASE = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4),
    "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=24),
}
TOL = 1e-5  # see the module docstring
STEPS = 5


def _reference(cfg):
    """The trainer's initial weights in a plain transformers model, trained on one process."""
    import transformers

    from framework.data import build_data
    from framework.models import family_of
    from framework.models.hf.model import hf_config
    from framework.optim import build_optimizer, build_scheduler

    family = family_of(cfg.model)
    task = family.task(cfg.model)
    torch.manual_seed(cfg.trainer.seed)  # the trainer's sequence: seed, a meta build, the real build
    family.build(cfg.model, "meta")
    built = family.build(cfg.model, "cpu")
    family.init_weights(built, cfg.trainer.seed)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config(cfg.model)), dtype=torch.float32)
    model.load_state_dict(built.state_dict())
    model.config.use_cache = False
    data = build_data(
        cfg.data,
        vocab_size=family.vocab_size(cfg.model),
        micro_batch_size=4,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        seed=cfg.trainer.seed,
        sample_kind=task.sample_kind,
        num_labels=family.num_labels(cfg.model),
    )
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, STEPS)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = task.loss(model, data.train.next_batch())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad_norm).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses, norms


def _rank(rank, world, run_dir, parallelism):
    import transformers

    from framework.runtime import Runtime
    from framework.trainer import Trainer

    out = {}
    for label, config in FAMILIES.items():
        cfg = make_config(config, "causal_lm", parallelism, f"{run_dir}/{label}")
        cfg.checkpoint.export_safetensors = True  # the job's export, written by every rank
        reference, ref_losses, ref_norms = _reference(cfg)
        trainer = Trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")))
        held = {  # the experts this rank holds: their piece of the state dict's (experts, ...) tensor
            name: (value.device_mesh.mesh_dim_names, tuple(value.to_local().shape))
            for name, value in trainer.model.state_dict().items()
            if name.endswith("layers.1.mlp.experts.down_proj")
        }
        steps = [trainer.train_step() for _ in range(STEPS)]
        ref_sd = reference.state_dict()
        worst = 0.0
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            worst = max(worst, (whole - ref_sd[name]).abs().max().item())
        path = trainer.ckpt.export(trainer.state, f"{run_dir}/{label}/export")
        loaded = {}
        if rank == 0:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
            loaded = {
                "missing": sorted(info["missing_keys"]),
                "unexpected": sorted(info["unexpected_keys"]),
                "worst": max((v - ref_sd[k]).abs().max().item() for k, v in model.state_dict().items()),
            }
        out[label] = {
            "losses": [s["loss"] for s in steps],
            "norms": [s["grad_norm"] for s in steps],
            "ref_losses": ref_losses,
            "ref_norms": ref_norms,
            "weights": worst,
            "held": held,
            "loaded": loaded,
        }
        trainer.ckpt.close()
        del trainer
    return out


@pytest.mark.parametrize("world, parallelism", [(2, {"ep": 2}), (4, {"ep": 2, "dp_shard": 4})], ids=["ep2", "ep2_dp2"])
def test_hf_moe_split_by_expert_equals_transformers_on_one_process(tmp_path, world, parallelism):
    from tests.distributed.harness import run_ranks

    results = run_ranks(_rank, world_size=world, args=(str(tmp_path), parallelism), timeout_s=300)
    for label in FAMILIES:
        for rank in range(world):
            r = results[rank][label]
            # each expert on one rank of the ep pair only (and sharded over the 2 efsdp ranks beside)
            [(mesh, shape)] = r["held"].values()
            assert "ep" in mesh and shape[0] == 4 // world, (label, r["held"])
            assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"]), (label, r)
            assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= TOL, (label, rank, r)
            assert max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"])) <= TOL, (label, rank, r)
            assert r["weights"] <= TOL, (label, rank, r["weights"])
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, losses)  # it trains
        loaded = results[0][label]["loaded"]
        assert loaded["missing"] == [] and loaded["unexpected"] == [], (label, loaded)
        assert loaded["worst"] <= TOL, (label, loaded)


def test_an_ep_that_does_not_divide_the_experts_is_refused_before_start(tmp_path):
    """Read from model.config or model.path's config.json, without torch; a count the config does
    not state (a dense model, or the config class's default) is checked when the model is built."""
    import json

    from framework.config.schema import ModelConfig
    from framework.models.families import model_problems

    inline = ModelConfig(name="hf", config=dict(FAMILIES["mixtral"], num_local_experts=6))
    (tmp_path / "config.json").write_text(json.dumps(dict(FAMILIES["qwen3_moe"], num_experts=6)))
    on_disk = ModelConfig(name="hf", path=str(tmp_path))
    assert model_problems(inline, 1, 16, 0, ep=4) == [
        "parallelism.ep=4 does not divide the 6 experts of model=hf (num_local_experts=6); "
        "choose an ep that divides them"
    ]
    assert "(num_experts=6)" in model_problems(on_disk, 1, 16, 0, ep=4)[0]
    assert model_problems(inline, 1, 16, 0, ep=2) == model_problems(on_disk, 1, 16, 0, ep=3) == []
