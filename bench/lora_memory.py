"""Memory per rank of full fine-tuning vs LoRA on our Llama through our sharded engine.

    .venv/bin/python bench/lora_memory.py                        # llama_125m, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/lora_memory.py --model debug --steps 2

Each mode runs in its own 2-rank process group (so each has its own RSS high-water mark): the
model is built with the same seed, LoRA (when on) adds rank-8 adapters to q_proj and v_proj and
freezes everything else, then the engine shards every block and the root, and AdamW runs `steps`
steps. Reported per rank, after the last step, before `zero_grad`:

  params     this rank's shards of the parameters (the engine's `shard` buffers)
  grads      gradient shards and any engine buffers held between steps (grad, accum, unsharded)
  optimizer  AdamW's state (exp_avg, exp_avg_sq) of the parameters it trains
  rss_peak   the process's peak resident memory (VmHWM), reset after the first step

The expected drop is at least the optimizer state of the frozen weights: 2 x 4 bytes x (frozen
parameters / ranks). Writes a table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import reset_rss_peak, rss_mb  # noqa: E402


def _worker(rank: int, world: int, port: int, model_name: str, lora: bool, steps: int, seq: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from omegaconf import OmegaConf

        from framework.config.schema import ModelConfig
        from framework.distributed.fsdp import fully_shard
        from framework.models.llama.model import build_llama
        from framework.peft import apply_lora

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        preset = OmegaConf.to_container(OmegaConf.load(os.path.join(root, "conf", "model", f"{model_name}.yaml")))
        cfg = ModelConfig(**preset)
        model = build_llama(cfg)
        model.init_weights(seed=0)
        if lora:
            apply_lora(model, rank=8, alpha=16, targets=["wq", "wv"], seed=1)
        unique = {id(p): p for p in model.parameters()}.values()
        frozen = sum(p.numel() for p in unique if not p.requires_grad)  # whole model, before sharding
        for block in model.layers:
            fully_shard(block)
        fully_shard(model, reshard_after_forward=False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)
        gen = torch.Generator().manual_seed(rank)
        for step in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            opt.step()
            if step == 0:
                reset_rss_peak()
            if step < steps - 1:
                opt.zero_grad(set_to_none=True)
        engine = model.sharded_tensor_bytes()
        optim = sum(
            v.numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        queue.put(
            (
                rank,
                {
                    "params_mb": engine["shard"] / 2**20,
                    "grads_mb": (
                        engine["grad_shard"]
                        + engine.get("accum", 0)
                        + engine.get("unsharded", 0)
                        + engine.get("grad_pool", 0)
                    )
                    / 2**20,
                    "optimizer_mb": optim / 2**20,
                    "rss_peak_mb": rss_mb(),
                    "frozen_numel": frozen,
                },
            )
        )
    finally:
        dist.destroy_process_group()


def run_mode(model_name: str, lora: bool, steps: int, seq: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, 2, port, model_name, lora, steps, seq, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < len(procs):
        try:
            rank, out = queue.get(timeout=5)
            results[rank] = out
        except Exception:  # noqa: BLE001 - queue.Empty: check that no rank died
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise RuntimeError("a rank failed; its traceback is above") from None
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank exited with status {p.exitcode}")
    return {k: max(results[r][k] for r in results) for k in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_125m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_memory_results.json")
    )
    args = parser.parse_args()
    rows = {mode: run_mode(args.model, mode == "lora", args.steps, args.seq) for mode in ("full", "lora")}
    full, lora = rows["full"], rows["lora"]
    frozen_optim_mb = 2 * 4 * lora["frozen_numel"] / 2 / 2**20  # exp_avg + exp_avg_sq, fp32, over 2 ranks
    print(f"model={args.model}, 2 ranks, our engine, fp32 AdamW; MiB per rank (the larger rank)")
    print(f"{'mode':6} {'params':>9} {'grads':>9} {'optimizer':>10} {'rss_peak':>10}")
    for mode, r in rows.items():
        print(f"{mode:6} {r['params_mb']:9.1f} {r['grads_mb']:9.1f} {r['optimizer_mb']:10.1f} {r['rss_peak_mb']:10.0f}")
    tensor_drop = (full["grads_mb"] + full["optimizer_mb"]) - (lora["grads_mb"] + lora["optimizer_mb"])
    rss_drop = full["rss_peak_mb"] - lora["rss_peak_mb"]
    print(
        f"tensor bytes drop {tensor_drop:.1f} MiB; RSS peak drop {rss_drop:.0f} MiB; "
        f"optimizer state of the frozen weights {frozen_optim_mb:.1f} MiB per rank"
    )
    with open(args.out, "w") as f:
        json.dump(
            {
                "model": args.model,
                "steps": args.steps,
                "seq": args.seq,
                "full": full,
                "lora": lora,
                "frozen_optimizer_state_mb_per_rank": frozen_optim_mb,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
