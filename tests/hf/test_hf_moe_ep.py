"""transformers' mixture-of-experts families split by expert (`parallelism.ep`, framework/models/hf/moe.py)
equal transformers on one process, and their exports load back into transformers.

For each family (tiny configs built here, nothing downloaded), the trainer runs 5 steps with ep=2
(2 ranks: each holds half the experts of every block) and with ep=2 x dp_shard=2 (4 ranks: each
expert sharded over 2 ranks besides), and a plain transformers model trained on one process from the
same initial weights on the same global batches gives the reference: the losses, the gradient
norms and every weight after 5 steps agree within 1e-5 (fp32). The sharded run sums the gradient in
another order (2 micro-batches per rank, the all-to-all's and reduce-scatter's sums) and the experts
multiply rows batched otherwise; that moves fp32 results by ~1e-7 a step (5e-7 at most seen), and
1e-5 leaves room for 5 steps of it while the losses themselves move by more than 0.1 over the 5
steps (asserted > 1e-3), so a step that trains otherwise shows. On 2 ranks Mixtral runs once more
with its blocks recomputed in backward (the all-to-alls run again inside the recomputation). Every
export (written by the ep job) loads in transformers with no missing or unexpected key and holds
the job's weights; Mixtral (one file tensor per expert) and gpt-oss (stacked files) also start from
save_pretrained directories, each rank reading only its slice of the experts.
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
    # MLA attention, a dense first block, shared experts, group-limited routing with the router's bias
    "deepseek_v3": dict(
        BASE,
        model_type="deepseek_v3",
        num_key_value_heads=4,  # MLA: as many key/value heads as query heads
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=24,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # biased experts with a clamped gate, attention sinks, sliding-window layers
    "gpt_oss": dict(BASE, model_type="gpt_oss", num_local_experts=4, head_dim=8, sliding_window=8),
}
TOL = 1e-5  # see the module docstring
STEPS = 5


def _reference(cfg):
    """The trainer's initial weights in a plain transformers model, trained on one process."""
    import transformers

    from framework.models import family_of
    from framework.models.hf.model import hf_config
    from tests.hf.one_process import train_steps, whole_batch_data

    family = family_of(cfg.model)
    task = family.task(cfg.model)
    torch.manual_seed(cfg.trainer.seed)  # the trainer's sequence: seed, a meta build, the real build
    family.build(cfg.model, "meta")
    built = family.build(cfg.model, "cpu")
    family.init_weights(built, cfg.trainer.seed)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config(cfg.model)), dtype=torch.float32)
    model.load_state_dict(built.state_dict())
    model.config.use_cache = False
    model.router_loads = _count_choices(model)
    losses, norms = train_steps(model, task, whole_batch_data(cfg, family, task), cfg, STEPS)
    return model, losses, norms


def _count_choices(model) -> list:
    """Per training step, each router's top-k choices per expert in a plain transformers model
    (its routers found by class name, in model order; counted by this test's own hook)."""
    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    steps: list = []

    def count(index):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return
            if index == 0:  # micro-batches of one step: the reference's step is one forward
                steps.append([[0] * module.num_experts for _ in routers])
            for e in output[-1].reshape(-1).tolist():
                steps[-1][index][e] += 1

        return hook

    for index, router in enumerate(routers):
        router.register_forward_hook(count(index))
    return steps


def _rank(rank, world, run_dir, parallelism):
    import transformers

    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label, (config, extra) in _cases(world).items():
        cfg = make_config(config, "causal_lm", {**parallelism, **extra}, f"{run_dir}/{label}")
        cfg.checkpoint.export_safetensors = True  # the job's export, written by every rank
        # the one-process reference on rank 0 only (the others wait in the job's first collective)
        reference, ref_losses, ref_norms = _reference(cfg) if rank == 0 else (None, None, None)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        held = {  # the experts this rank holds: their piece of the state dict's (experts, ...) tensor
            name: (value.device_mesh.mesh_dim_names, tuple(value.to_local().shape))
            for name, value in trainer.model.state_dict().items()
            if name.endswith("layers.1.mlp.experts.down_proj")
        }
        steps = [trainer.train_step() for _ in range(STEPS)]
        ref_sd = reference.state_dict() if rank == 0 else None
        worst = 0.0
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if ref_sd is not None:  # every rank gathers (a collective), rank 0 compares
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
            # the step records' router statistics, and the reference's choices counted per step
            "loads": [{k: v for k, v in s.items() if k.startswith("moe_")} for s in steps],
            "ref_loads": reference.router_loads if rank == 0 else None,
        }
        trainer.ckpt.close()
        del trainer
        if label in SOURCES:
            out[label]["from_files"] = _start_from_files(rank, world, f"{run_dir}/{label}", parallelism)
    return out


def _cases(world: int) -> dict:
    """{label: (config, parallelism beside ep)}: every family, and on 2 ranks Mixtral with its blocks
    recomputed in backward (the all-to-alls run again inside the recomputation)."""
    cases = {label: (config, {}) for label, config in FAMILIES.items()}
    if world == 2:
        cases["mixtral_recomputed"] = (FAMILIES["mixtral"], {"activation_checkpointing": "full"})
    return cases


SOURCES = ("mixtral", "gpt_oss")  # files of one tensor per expert (merged on load), and stacked ones
READ = {  # the expert tensors of a block as save_pretrained writes them
    "mixtral": ["w1", "w2", "w3"],
    "gpt_oss": ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"],
}


def _start_from_files(rank, world, run_dir, parallelism):
    """Start from a save_pretrained directory; return the largest difference between the job's
    gathered weights and transformers' own load of it, and the experts this rank read per tensor."""
    import re

    import transformers

    import framework.checkpoint.hf as files
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    read: dict[str, set] = {}

    def note(key, rows):
        match = re.search(r"layers\.1\.\w+\.experts\.(\d+\.)?(\w+)", key)
        if match:
            read.setdefault(match.group(2), set()).update(rows)

    class Slice:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            rows = index[0] if isinstance(index, tuple) else index
            note(self.key, range(*rows.indices(self.inner.get_shape()[0])))
            return self.inner[index]

    class Spy:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, key):
            if "experts" in key:
                expert = re.search(r"experts\.(\d+)\.", key)
                note(key, [int(expert.group(1))] if expert else range(self.inner.get_slice(key).get_shape()[0]))
            return self.inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_slice(self, key):
            return Slice(key, self.inner.get_slice(key))

    opener = files.open_safetensors
    files.open_safetensors = lambda path, where: Spy(opener(path, where))
    try:
        cfg = make_config({}, "causal_lm", parallelism, run_dir, path=f"{run_dir}/source")
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        assert trainer.ckpt.resume(trainer.state) == 0
    finally:
        files.open_safetensors = opener
    truth = transformers.AutoModelForCausalLM.from_pretrained(f"{run_dir}/source").state_dict()
    worst = 0.0
    for name, value in trainer.model.state_dict().items():
        whole = value.full_tensor() if hasattr(value, "full_tensor") else value
        worst = max(worst, (whole - truth[name]).abs().max().item())
    trainer.ckpt.close()
    return {"worst": worst, "read": {k: sorted(v) for k, v in read.items()}}


@pytest.mark.parametrize("world, parallelism", [(2, {"ep": 2}), (4, {"ep": 2, "dp_shard": 4})], ids=["ep2", "ep2_dp2"])
def test_hf_moe_split_by_expert_equals_transformers_on_one_process(tmp_path, world, parallelism):
    import transformers

    from tests.distributed.harness import run_ranks

    for label in SOURCES:
        config = dict(FAMILIES[label])
        torch.manual_seed(3)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        )
        model.save_pretrained(tmp_path / label / "source")
    results = run_ranks(_rank, world_size=world, args=(str(tmp_path), parallelism), timeout_s=300)
    for label in _cases(world):
        for rank in range(world):
            r, ref = results[rank][label], results[0][label]  # the reference ran on rank 0
            # each expert on one rank of the ep pair only (and sharded over the 2 efsdp ranks beside)
            [(mesh, shape)] = r["held"].values()
            assert "ep" in mesh and shape[0] == 4 // world, (label, r["held"])
            assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"]), (label, r)
            assert max(abs(a - b) for a, b in zip(r["losses"], ref["ref_losses"])) <= TOL, (
                label,
                rank,
                r,
            )
            assert max(abs(a - b) for a, b in zip(r["norms"], ref["ref_norms"])) <= TOL, (label, rank, r)
            assert r["weights"] <= TOL, (label, rank, r["weights"])
            # every router's choices per expert over the global batch (summed over the ranks, each
            # slot once under recomputation) are one process's, every step; max over mean from them
            ref_loads = ref["ref_loads"]
            assert len(ref_loads) == STEPS and ref_loads[0], (label, ref_loads)
            for got, want in zip(r["loads"], ref_loads):
                assert got.keys() == {f"moe_{k}_l{i}" for i in range(len(want)) for k in ("load", "max_mean")}
                for i, counts in enumerate(want):
                    assert got[f"moe_load_l{i}"] == counts, (label, rank, i, got, want)
                    assert sum(counts) == 4 * 16 * 2  # global batch 4 rows of 16 tokens, top-2
                    assert got[f"moe_max_mean_l{i}"] == pytest.approx(max(counts) / (sum(counts) / len(counts)))
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, losses)  # it trains
        loaded = results[0][label]["loaded"]
        assert loaded["missing"] == [] and loaded["unexpected"] == [], (label, loaded)
        assert loaded["worst"] <= TOL, (label, loaded)
    # Started from save_pretrained files, the weights are transformers' own load of them exactly, and
    # each rank read only its slice of each expert tensor: 4 / world experts, no two ranks the same.
    for label in SOURCES:
        starts = [results[rank][label]["from_files"] for rank in range(world)]
        assert all(s["worst"] == 0.0 for s in starts), (label, starts)
        assert sorted(starts[0]["read"]) == READ[label], (label, starts[0]["read"])
        for tensor in starts[0]["read"]:
            held = [s["read"][tensor] for s in starts]
            assert all(len(h) == 4 // world for h in held), (label, tensor, held)
            assert sorted(e for h in held for e in h) == [0, 1, 2, 3], (label, tensor, held)


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
    # split by expert inside pipeline stages and beside tensor parallelism (tests/hf/test_hf_moe_dims.py)
    assert model_problems(inline, 1, 16, 0, ep=2, pp=2) == model_problems(inline, 2, 16, 0, ep=2) == []
    assert model_problems(inline, 1, 16, 0, ep=1, pp=2) == []


def test_the_planner_splits_each_blocks_experts_over_ep():
    """stage=plan's units at ep=2: each block's stacked experts a unit of their own, half of them,
    sharded over the efsdp ranks (as the engine lays them out), the rest of the block unchanged."""
    from framework.config.schema import ModelConfig
    from framework.models.hf.shapes import plan_shape
    from framework.models.shapes import units

    shape = plan_shape(ModelConfig(name="hf", config=FAMILIES["qwen3_moe"]), 128)
    whole = {u.name: u for u in units(shape, 1, 1)}
    split = {u.name: u for u in units(shape, 1, 2)}
    for block in ("block.0", "block.1"):
        experts = split[f"{block}.model.layers.{block[-1]}.mlp.experts"]
        assert experts.shard == "efsdp" and sorted(t.name.rpartition(".")[2] for t in experts.tensors) == [
            "down_proj",
            "gate_up_proj",
        ]
        # 4 experts of (48 x 32) gate-up and (32 x 24) down, half of them per ep rank
        assert sum(t.numel for t in experts.tensors) == 4 * (48 * 32 + 32 * 24) // 2
        assert sum(t.numel for t in split[block].tensors) + 2 * sum(t.numel for t in experts.tensors) == sum(
            t.numel for t in whole[block].tensors
        )


CASES = [(implementation, idle) for implementation in ("grouped_mm", "eager") for idle in (False, True)]


def _experts_worker(rank, world):
    return {case: _experts_case(rank, *case) for case in CASES}


def _experts_case(rank, implementation: str, idle: bool):
    import torch.distributed as dist

    from framework.config.schema import ModelConfig
    from framework.distributed.expert_parallel import apply_expert_parallel
    from framework.models.hf.model import build_hf

    torch.manual_seed(0)
    model = build_hf(ModelConfig(name="hf", config=FAMILIES["mixtral"], task="causal_lm"))
    model.config._experts_implementation = implementation
    experts = model.model.layers[0].mlp.experts
    whole = copy.deepcopy(experts)  # every expert, no dispatch: transformers' own forward
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(6, 32, generator=gen)
    # two distinct experts per token; with `idle`, only experts 0 and 1 (rank 0's): rank 1 gets no row
    index = torch.rand(6, 2 if idle else 4, generator=gen).argsort(dim=1)[:, :2]
    weights = torch.rand(6, 2, generator=gen)
    apply_expert_parallel(model, 2, 1, "cpu")
    probe = torch.linspace(-1, 1, 32)
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = experts(ours, index, weights)
    (out * probe).square().sum().backward()
    expected = whole(ref, index, weights)
    (expected * probe).square().sum().backward()
    worst = {"out": (out - expected).abs().max().item(), "input_grad": (ours.grad - ref.grad).abs().max().item()}
    for name, param in whole.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        dist.all_reduce(grad)  # an expert's gradient sums every rank's tokens routed to it
        mine = getattr(experts, name).grad
        mine = mine.to_local() if mine is not None else torch.zeros(2, *param.shape[1:])
        worst[name] = (mine - grad[2 * rank : 2 * rank + 2]).abs().max().item()
    return worst


def test_rows_reach_their_experts_and_gradients_come_home():
    """One experts module split over 2 ranks, against the whole module on each rank's tokens: the
    outputs and input gradients equal, each held expert's gradient the sum over both ranks' tokens
    (1e-6: the same products in another batching). A rank no row reaches still joins both
    all-to-alls' backward (with transformers' eager loop, which skips an expert without rows, it
    would wait forever otherwise) and its experts' gradients are zero. Each case with transformers'
    grouped and eager implementations, with and without the idle rank."""
    from tests.distributed.harness import run_ranks

    for result in run_ranks(_experts_worker, world_size=2, timeout_s=120):
        for case, worst in result.items():
            assert max(worst.values()) <= 1e-6, (case, worst)
