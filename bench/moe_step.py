"""Step time of our Llama with experts against a dense Llama of the same active parameters (CPU).

    .venv/bin/python bench/moe_step.py                      # the recorded run (bench/RESULTS.md)
    .venv/bin/python bench/moe_step.py --steps 3 --rounds 1 # a quick check of the script

Both models: d 256, 4 blocks, 4 heads (2 KV), vocabulary 4096, 256 tokens x 4 samples a step,
fp32, one process with one compute thread, AdamW. The MoE has 8 experts of inner size 256 and
routes each token to 2 (dropless), so a token meets 2 x 256 = 512 SwiGLU units; the dense model's
SwiGLU is 512 wide. Active parameters per token are equal but for the router (d x 8 per block),
which the table shows. The MoE holds 4x the expert parameters (and their AdamW state).

How the MoE computes (framework/models/llama/moe.py): a Python loop over the experts, not over
tokens: each expert takes the rows routed to it as one batch (three matmuls on them), then the
outputs are added back with `index_add`; so a step issues 8 small matmul triples per block where
the dense model issues one large one, plus the routing's gathers and scatters. There is no grouped
GEMM (all experts in one kernel) in this build. Rounds interleave the two models (each round one
warm-up step and `--steps` timed steps of each, alternating which goes first); the table gives the
median over all timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config.schema import ModelConfig  # noqa: E402
from framework.models.llama import build_llama  # noqa: E402

BASE = dict(vocab_size=4096, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
MOE = dict(BASE, ffn_dim=256, n_experts=8, top_k=2, moe_ffn_dim=256, n_shared_experts=0)
DENSE = dict(BASE, ffn_dim=512)
SEQ, MICRO = 256, 4


def active_params(model, cfg) -> int:
    """Parameters one token uses: all, less the experts it is not routed to."""
    total = sum(p.numel() for p in model.parameters())
    if not cfg.get("n_experts"):
        return total
    per_expert = 3 * cfg["moe_ffn_dim"] * cfg["dim"]
    return total - cfg["n_layers"] * (cfg["n_experts"] - cfg["top_k"]) * per_expert


def build(cfg):
    torch.manual_seed(0)
    model = build_llama(ModelConfig(args=cfg))
    model.init_weights(0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, tokens) -> float:
    t0 = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
    aux = getattr(model, "aux_loss", None)
    if callable(aux):
        aux = aux()
    if isinstance(aux, torch.Tensor):
        loss = loss + aux
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "moe_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    models = {"moe (8 experts, top-2)": (MOE, *build(MOE)), "dense (same active)": (DENSE, *build(DENSE))}
    g = torch.Generator().manual_seed(0)
    times = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _, model, opt = models[name]
            tokens = torch.randint(0, BASE["vocab_size"], (MICRO, SEQ + 1), generator=g)
            step(model, opt, tokens)  # warm-up
            for _ in range(args.steps):
                tokens = torch.randint(0, BASE["vocab_size"], (MICRO, SEQ + 1), generator=g)
                times[name].append(step(model, opt, tokens))
    rows = []
    dense_median = statistics.median(times[names[1]])
    for name, (cfg, model, _) in models.items():
        med = statistics.median(times[name])
        rows.append(
            {
                "model": name,
                "params": sum(p.numel() for p in model.parameters()),
                "active_params": active_params(model, cfg),
                "median_step_s": med,
                "min_s": min(times[name]),
                "max_s": max(times[name]),
                "vs_dense": med / dense_median,
                "tokens_per_s": MICRO * SEQ / med,
            }
        )
    print("| model | parameters | active per token | median step s (min-max) | tokens/s | vs dense |")
    print("|---|---:|---:|---|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.3f}M | "
            f"{r['median_step_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | {r['tokens_per_s']:,.0f} | "
            f"{r['vs_dense']:.2f}x |"
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"moe": MOE, "dense": DENSE, "seq": SEQ, "micro": MICRO}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
