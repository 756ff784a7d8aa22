"""Per-rank memory of our engine with and without int8 communication (parallelism.quantized_comm).

    .venv/bin/python bench/quantized_memory.py                 # llama_125m, 2 gloo ranks, CPU, fp32
    .venv/bin/python bench/quantized_memory.py --model debug   # seconds, for a smoke run

Each setting runs in its own pair of processes (so each peak RSS is its own): the model is built
on the meta device and materialised shard by shard (as the trainer does for large models),
sharded by `parallelize`, then trains `--steps` AdamW steps on random tokens. Reported per rank:
peak RSS (VmHWM), RSS at the end, and tensor bytes = the engine's `sharded_tensor_bytes()["total"]`
(shards, grad shards, unsharded storage, buffers and pools) + the optimizer state.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import rss_mb  # noqa: E402


def _rank(rank: int, world: int, port: int, model_name: str, quantized: bool, steps: int, seq: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from omegaconf import OmegaConf

    from framework.config.schema import Engine, ModelConfig, ParallelismConfig
    from framework.distributed.parallel_dims import ParallelDims, build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.models import build_model, family_of

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = OmegaConf.to_container(OmegaConf.load(os.path.join(root, "conf", "model", f"{model_name}.yaml")))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in raw.items() if k in fields})
    dims = ParallelDims(dp_replicate=1, dp_shard=world, tp=1, world_size=world)
    mesh = build_mesh(dims, "cpu")
    family = family_of(cfg)
    model = build_model(cfg, "meta")
    pcfg = ParallelismConfig(engine=Engine.native, dp_shard=world, quantized_comm=quantized)
    model = parallelize(model, dims, mesh, pcfg, family)
    model.to_empty(device="cpu")
    torch.manual_seed(rank)
    family.init_weights(model, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, seq + 1), generator=g)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    engine = model.sharded_tensor_bytes()
    optim = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    queue.put(
        (
            rank,
            {
                "peak_rss_mb": rss_mb("VmHWM"),
                "rss_mb": rss_mb("VmRSS"),
                "tensor_mb": (engine["total"] + optim) / 2**20,
                "engine": engine,
            },
        )
    )
    dist.destroy_process_group()


def run(model: str, quantized: bool, steps: int, seq: int, world: int = 2) -> list:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, model, quantized, steps, seq, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out = {}
    while len(out) < world:
        try:
            rank, res = queue.get(timeout=5)
            out[rank] = res
        except Exception:  # queue.Empty: stop if a rank died
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join()
    return [out[r] for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama_125m")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    res = {q: run(args.model, q, args.steps, args.seq) for q in (False, True)}
    print(f"{'quantized_comm':>15} {'rank':>4} {'peak RSS MB':>12} {'RSS MB':>8} {'tensor MB':>10}")
    for q, ranks in res.items():
        for r, v in enumerate(ranks):
            print(f"{str(q):>15} {r:>4} {v['peak_rss_mb']:12.0f} {v['rss_mb']:8.0f} {v['tensor_mb']:10.1f}")
    for key in ("peak_rss_mb", "tensor_mb"):
        ratio = max(v[key] for v in res[True]) / max(v[key] for v in res[False])
        print(f"{key}: quantized / plain = {ratio:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(k): v for k, v in res.items()}, f, indent=1)


if __name__ == "__main__":
    main()
