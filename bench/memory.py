"""Per-rank memory of our engine in two settings of one feature, A against B.

    .venv/bin/python bench/memory.py lora            # full fine-tuning vs LoRA, llama_125m, 2 ranks
    .venv/bin/python bench/memory.py quantized       # plain vs int8 communication (quantized_comm)
    .venv/bin/python bench/memory.py lora --model debug --steps 2     # seconds, for a smoke run

Each setting runs in its own 2-rank gloo process group (so each peak RSS is its own): our Llama is
built with the same seed as the trainer would, LoRA (when on) adds rank-8 adapters to q and v and
freezes everything else, `parallelize` shards every block and the root (int8 communication when
on), then AdamW runs `--steps` steps on random tokens. Reported per rank (the larger rank), after
the last step, before `zero_grad`:

  params     this rank's shards of the parameters (the engine's `shard` buffers)
  grads      gradient shards and the engine buffers held then (accumulation, unsharded storage, pool)
  optimizer  AdamW's state of the parameters it trains
  rss_peak   the process's peak resident memory (VmHWM), reset after the first step

For LoRA the expected drop is at least the optimizer state of the frozen weights, 2 x 4 bytes x
(frozen parameters / ranks). Writes a table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import reset_rss_peak, rss_mb  # noqa: E402
from framework.local_ranks import run_local  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
FEATURES = {"lora": ("full", "lora"), "quantized": ("plain", "int8")}  # feature: (A, B)


def _worker(rank: int, world: int, model_name: str, feature: str, on: bool, steps: int, seq: int) -> dict:
    from omegaconf import OmegaConf

    from framework.config.schema import Engine, ModelConfig, ParallelismConfig
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.models import build_model, family_of
    from framework.peft import apply_lora

    preset = OmegaConf.to_container(OmegaConf.load(os.path.join(BENCH, "..", "conf", "model", f"{model_name}.yaml")))
    cfg = ModelConfig(**preset)
    family = family_of(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    family.init_weights(model, 0)
    if feature == "lora" and on:
        apply_lora(model, rank=8, alpha=16, targets=["wq", "wv"], seed=1)
    frozen = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if not p.requires_grad)
    dims = ParallelDims(dp_replicate=1, dp_shard=world, tp=1, world_size=world)
    pcfg = ParallelismConfig(engine=Engine.native, dp_shard=world, quantized_comm=feature == "quantized" and on)
    model = parallelize(model, dims, build_mesh(dims, "cpu"), pcfg, family)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        tokens = torch.randint(0, cfg.args["vocab_size"], (1, seq + 1), generator=gen)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        if step == 0:
            reset_rss_peak()
        if step < steps - 1:
            opt.zero_grad(set_to_none=True)
    held = model.sharded_tensor_bytes()
    optim = sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    grads = held["grad_shard"] + held["accum"] + held["unsharded"] + held["grad_pool"]
    return {
        "params_mb": held["shard"] / 2**20,
        "grads_mb": grads / 2**20,
        "optimizer_mb": optim / 2**20,
        "rss_peak_mb": rss_mb(),
        "frozen_numel": frozen,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("feature", choices=sorted(FEATURES), help="what B turns on against A")
    parser.add_argument("--model", default="llama_125m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", default=None, help="JSON results (default bench/memory_<feature>_results.json)")
    args = parser.parse_args()
    a, b = FEATURES[args.feature]
    rows = {}
    for name, on in ((a, False), (b, True)):
        ranks = run_local(_worker, 2, args=(args.model, args.feature, on, args.steps, args.seq), timeout_s=1800)
        rows[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print(f"model={args.model}, 2 ranks, our engine, fp32 AdamW, {args.feature}: MiB per rank (the larger rank)")
    print(f"{'setting':8} {'params':>9} {'grads':>9} {'optimizer':>10} {'rss_peak':>10}")
    for name, r in rows.items():
        print(f"{name:8} {r['params_mb']:9.1f} {r['grads_mb']:9.1f} {r['optimizer_mb']:10.1f} {r['rss_peak_mb']:10.0f}")
    tensors = {name: r["params_mb"] + r["grads_mb"] + r["optimizer_mb"] for name, r in rows.items()}
    print(
        f"tensor bytes {b} / {a} = {tensors[b] / tensors[a]:.3f}; "
        f"RSS peak {b} - {a} = {rows[b]['rss_peak_mb'] - rows[a]['rss_peak_mb']:.0f} MiB"
    )
    out = {"model": args.model, "steps": args.steps, "seq": args.seq, a: rows[a], b: rows[b]}
    if args.feature == "lora":
        out["frozen_optimizer_state_mb_per_rank"] = 2 * 4 * rows[b]["frozen_numel"] / 2 / 2**20
        print(f"optimizer state of the frozen weights: {out['frozen_optimizer_state_mb_per_rank']:.1f} MiB per rank")
    path = args.out or os.path.join(BENCH, f"memory_{args.feature}_results.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
