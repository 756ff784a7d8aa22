"""Tensor-parallel rows: step time and per-rank memory of our Llama at several (dp_shard x tp) layouts.

    .venv/bin/python bench/tp.py                    # 2 gloo ranks: dp2, tp2, tp2+SP (torch engine)
    .venv/bin/python bench/tp.py --ranks 4 --steps 4
    .venv/bin/python bench/engine.py --tp           # the engine table, then these rows

Every layout trains the same model on the same global batch (fixed tokens per step), through the
framework's own `parallelize` (TP plan, then fully_shard per block and root), loss under
`loss_parallel`, SGD. One spawn per layout (its process group holds the mesh); 2 warm-up steps,
then the median of --steps. "tensor MB" = this rank's parameters + gradients + optimizer state
(local shards). Engines that refuse a layout (the native engine without DTensor parameters) get
a row saying so. On CPU with gloo the tp collectives (two all-reduces per block forward, two in
backward) dominate at this size; the table is for relative comparison on one machine, not for
extrapolating to GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config.schema import Engine, ModelConfig, ParallelismConfig  # noqa: E402
from framework.local_ranks import run_local  # noqa: E402
from framework.models.llama.args import llama_args  # noqa: E402

MODEL = ModelConfig(
    name="bench",
    args=dict(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=128),
)
SIZES = llama_args(MODEL)
GLOBAL_BATCH = 8  # samples of 128 tokens per step, split over the dp ranks: 1,024 tokens/step


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(rank: int, world: int, dp_shard: int, tp: int, sp: bool, engine: str, steps: int) -> dict:
    from framework.distributed.engines import engine_of
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.distributed.tensor_parallel import full, loss_context
    from framework.models.llama.family import FAMILY as LLAMA
    from framework.models.llama.model import build_llama
    from framework.models.tasks import cross_entropy as loss_fn

    dims = ParallelDims(dp_replicate=1, dp_shard=dp_shard, tp=tp, world_size=world)
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    model = build_llama(MODEL)
    model.init_weights(seed=0)
    cfg = ParallelismConfig(engine=Engine(engine), dp_shard=dp_shard, tp=tp, sequence_parallel=sp)
    try:
        model = parallelize(model, dims, mesh, cfg, LLAMA)
    except NotImplementedError as exc:
        return {"refused": str(exc)}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    per_rank = GLOBAL_BATCH // dp_shard
    gen = torch.Generator().manual_seed(1 + mesh["dp_shard"].get_local_rank())
    times = []
    for s in range(2 + steps):
        tokens = torch.randint(SIZES.vocab_size, (per_rank, SIZES.max_seq_len + 1), generator=gen)
        dist.barrier()
        tic = time.perf_counter()
        with loss_context(model):
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        full(loss.detach())
        engine_of(cfg.engine).clip_grad_norm(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients: they count in the memory column
        if s >= 2:
            times.append(time.perf_counter() - tic)
    tensors = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    return {"times": times, "tensor_bytes": sum(_local_bytes(t) for t in tensors)}


def layouts(ranks: int):
    """(dp_shard, tp, sequence_parallel) rows for a world of `ranks`."""
    rows = [(ranks, 1, False)]
    tp = 2
    while tp <= ranks and SIZES.n_kv_heads % tp == 0:
        rows += [(ranks // tp, tp, False), (ranks // tp, tp, True)]
        tp *= 2
    return rows


def run(ranks: int, steps: int, engines, out: str | None = None) -> dict:
    rows = []
    for engine in engines:
        for dp, tp, sp in layouts(ranks):
            res = run_local(worker, ranks, args=(dp, tp, sp, engine, steps), timeout_s=900)
            row = {"engine": engine, "dp_shard": dp, "tp": tp, "sequence_parallel": sp}
            if "refused" in res[0]:
                row["refused"] = res[0]["refused"]
            else:
                step_s = statistics.median(max(r["times"][i] for r in res) for i in range(steps))
                row.update(
                    median_step_s=step_s,
                    tokens_per_s=GLOBAL_BATCH * SIZES.max_seq_len / step_s,
                    tensor_mb_per_rank=max(r["tensor_bytes"] for r in res) / 2**20,
                )
            rows.append(row)
    n_params = sum(p.numel() for p in _plain_model().parameters())
    print(
        f"\nLlama {n_params / 1e6:.1f}M params, {ranks} gloo ranks, CPU fp32, {GLOBAL_BATCH} x "
        f"{SIZES.max_seq_len} tokens/step, median of {steps} steps"
    )
    print(f"{'engine':7} {'dp x tp':>8} {'SP':>3} {'step s':>8} {'tok/s':>8} {'tensor MB/rank':>15}")
    for r in rows:
        layout = f"{r['dp_shard']}x{r['tp']}"
        sp = "yes" if r["sequence_parallel"] else "no"
        if "refused" in r:
            print(f"{r['engine']:7} {layout:>8} {sp:>3}  refused: {r['refused'][:90]}")
        else:
            print(
                f"{r['engine']:7} {layout:>8} {sp:>3} {r['median_step_s']:8.3f} {r['tokens_per_s']:8.0f} "
                f"{r['tensor_mb_per_rank']:15.1f}"
            )
    result = {"model": dataclasses.asdict(MODEL), "ranks": ranks, "steps": steps, "rows": rows}
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    return result


def _plain_model():
    from framework.models.llama import build_llama

    return build_llama(MODEL, "meta")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per layout (after 2 warm-up)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--engines", default="torch,native", help="comma-separated: torch, native")
    ap.add_argument("--out", default="bench/tp_results.json")
    args = ap.parse_args()
    run(args.ranks, args.steps, args.engines.split(","), args.out)


if __name__ == "__main__":
    main()
