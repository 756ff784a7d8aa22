"""Cluster-scale memory and traffic of the real engine, simulated in one process, vs the planner.

    .venv/bin/python bench/simulate.py                         # llama_7b and llama_70b, 8..1024 ranks
    .venv/bin/python bench/simulate.py --models llama_7b --worlds 8 64 --json bench/simulate.json

For every row a process group of the given world size is created with torch's "fake" backend
(`init_process_group("fake", rank=0, world_size=N)`: every collective returns at once, nothing is
sent), the model is built on the meta device (shapes, no memory), parallelized exactly as the
trainer does it (`framework.distributed.parallelize`), and one training step runs through our
engine: forward, backward (every gather, reduce-scatter, all-reduce and all-to-all the engine
issues), optimizer step. We record rank 0's tensor bytes (shards, gradient shards, the buffers the
engine holds, the optimizer state) and the bytes of every collective call, intercepted at
`torch.distributed` and converted to per-rank bytes by the ring formulas of
`framework/distributed/fsdp/collectives.py`; then we compare with the planner's prediction for
the same job. Layouts: full (ZeRO-3 over all ranks), hybrid (sharded over 8 ranks per node,
replicated across nodes), tp8 (tensor parallel over 8, ZeRO-3 over the rest). Tensor parallel's
activation traffic goes through torch's functional collectives, counted where they are dispatched
(`torch.utils._python_dispatch.TorchDispatchMode`, the documented way to intercept ops).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

try:  # the dispatch-mode base class lives in a private module (there is no public one)
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # then tensor-parallel traffic is not counted (and not compared)
    TorchDispatchMode = object

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config.schema import (
    ClusterConfig,
    Config,
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    TrainerConfig,
)
from framework.planner import job_from_config, memory, traffic

LAYOUTS = {
    "full": lambda w: {"strategy": "full", "dp_replicate": 1, "dp_shard": w, "tp": 1},
    "hybrid": lambda w: {"strategy": "hybrid", "dp_replicate": w // 8, "dp_shard": 8, "tp": 1},
    "tp8": lambda w: {"strategy": "full", "dp_replicate": 1, "dp_shard": w // 8, "tp": 8},
}
TOLERANCE = 0.05  # the bound; the arithmetic is meant to agree exactly


def model_config(name: str) -> ModelConfig:
    import yaml

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "model", f"{name}.yaml")
    with open(path) as f:
        fields = yaml.safe_load(f)
    return ModelConfig(**{k: v for k, v in fields.items() if k in ModelConfig.__dataclass_fields__})


def job_config(model: str, world: int, layout: str, seq: int, micro: int) -> Config:
    p = ParallelismConfig(**LAYOUTS[layout](world))
    dp = world // p.tp
    return Config(
        model=model_config(model),
        parallelism=p,
        data=DataConfig(name="synthetic", seq_len=seq),
        trainer=TrainerConfig(micro_batch_size=micro, global_batch_size=micro * dp),
        cluster=ClusterConfig(nodes=max(1, world // 8), nproc_per_node=min(8, world), gpus_per_node=8),
    )


# ------------------------------------------------------------------ recording collectives
class _FunctionalCollectives(TorchDispatchMode):
    """DTensor (tensor parallel) communicates through torch's functional collectives, which never
    pass through the Python functions above: count them where they are dispatched. In these
    layouts only tensor parallel uses them, over groups of `tp` ranks."""

    RING = {
        "all_reduce": lambda n, b: 2 * (n - 1) * b // n,
        "all_gather_into_tensor": lambda n, b: (n - 1) * b,
        "reduce_scatter_tensor": lambda n, b: (n - 1) * b // n,
    }

    def __init__(self, recorder: "Recorder", tp: int) -> None:
        super().__init__()
        self.recorder, self.tp = recorder, tp

    enabled = TorchDispatchMode is not object

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns, _, name = str(func).partition(".")
        name = name.split(".")[0]
        if ns == "_c10d_functional" and name in self.RING and self.tp > 1:
            t = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            key = (name.removesuffix("_into_tensor").removesuffix("_tensor"), self.tp, ("tp",))
            self.recorder.bytes[key] += self.RING[name](self.tp, t.numel() * t.element_size())
            self.recorder.calls[key] += 1
        return func(*args, **(kwargs or {}))


class Recorder:
    """Wraps torch.distributed's collectives in this process; per-rank bytes by group."""

    NAMES = (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_to_all_single",
        "broadcast",
    )

    def __init__(self, tp: int = 1) -> None:
        self.bytes = defaultdict(int)  # (collective, group size, group ranks) -> bytes
        self.calls = defaultdict(int)
        self._orig = {}
        self._mode = _FunctionalCollectives(self, tp)

    def __enter__(self):
        for name in self.NAMES:
            if hasattr(dist, name):
                self._orig[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._orig[name]))
        if self._mode.enabled:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode.enabled:
            self._mode.__exit__(*exc)
        for name, fn in self._orig.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def recorded(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            group = a.get("group")
            n = dist.get_world_size(group)
            nb = lambda t: t.numel() * t.element_size()
            if name.startswith("all_gather"):
                kind, b = "all_gather", (n - 1) * nb(a.get("input_tensor", a.get("input")))
            elif name.startswith("reduce_scatter"):
                inp = a.get("input", a.get("input_tensor"))
                kind, b = "reduce_scatter", (n - 1) * nb(inp) // n
            elif name == "all_reduce":
                kind, b = "all_reduce", 2 * (n - 1) * nb(a["tensor"]) // n
            elif name == "all_to_all_single":
                kind, b = "all_to_all", (n - 1) * nb(a["input"]) // n
            else:
                kind, b = "broadcast", nb(a["tensor"])
            key = (kind, n, tuple(dist.get_process_group_ranks(group)) if group is not None else ("world",))
            self.bytes[key] += b
            self.calls[key] += 1
            return fn(*args, **kwargs)

        return recorded


class _mesh_coordinates:
    """The engine asks every rank for its mesh coordinates and its dp and tp ranks once
    (`all_gather_object`, to build the checkpoint mesh under tensor parallel); a fake group answers
    nothing, so answer for the other ranks here: rank r of the row-major (dp_replicate, dp_shard,
    tp) mesh, with the replicate coordinate left out when the engine's dp mesh is 1-D."""

    def __init__(self, dims) -> None:
        self.dims = dims

    def __enter__(self):
        self._orig = dist.all_gather_object
        R, S, T = self.dims.dp_replicate, self.dims.dp_shard, self.dims.tp

        def gather(out, obj, group=None):
            # obj: (this rank's coordinates, its dp mesh's ranks, its tp mesh's ranks)
            if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], tuple) and len(out) == R * S * T:
                hybrid = len(obj[0]) == 3
                for r in range(len(out)):
                    rep, shard, t = r // (S * T), (r // T) % S, r % T
                    coords = (rep, shard, t) if hybrid else (shard, t)
                    reps = range(R) if hybrid else (rep,)
                    dp = [q * S * T + k * T + t for q in reps for k in range(S)]
                    out[r] = (coords, dp, [r - t + k for k in range(T)])
                return None
            return self._orig(out, obj, group=group)

        dist.all_gather_object = gather
        return self

    def __exit__(self, *exc):
        dist.all_gather_object = self._orig


def simulate_row(model: str, world: int, layout: str, seq: int = 2048, micro: int = 1) -> dict:
    """One traced step of the engine on a fake process group of `world` ranks; rank 0's view."""
    import torch.nn.functional as F

    from framework.config.validate import parallel_dims_of
    from framework.distributed.fsdp import context as fsdp_context
    from framework.distributed.parallel_dims import build_mesh
    from framework.distributed.parallelize import parallelize
    from framework.distributed.tensor_parallel import loss_context
    from framework.models import family_of
    from framework.models.llama import build_llama

    cfg = job_config(model, world, layout, seq, micro)
    p = cfg.parallelism
    # The reduction pool is read after the traced step; off the host the engine lets it go at the
    # end of backward ([Note: the gradient buffer pool]), so keep it on the meta device to read the
    # size it has during backward, which is what the planner's grad_pool is.
    kept = fsdp_context.POOL_KEPT_BETWEEN_STEPS_ON
    fsdp_context.POOL_KEPT_BETWEEN_STEPS_ON = kept | {"meta"}
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        dims = parallel_dims_of(cfg, world)  # the same cluster shape the planner is given
        mesh = build_mesh(dims, "cpu")
        dim_of = {}
        for name in ("dp_replicate", "dp_shard", "tp"):
            dim_of[tuple(dist.get_process_group_ranks(mesh[name].get_group()))] = name
        dim_of[("tp",)] = "tp"
        model_ = build_llama(cfg.model, "meta")
        with _mesh_coordinates(dims):
            model_ = parallelize(model_, dims, mesh, p, family_of(cfg.model))
        opt = torch.optim.AdamW(model_.parameters(), lr=1e-4, foreach=False)
        tokens = torch.zeros(micro, seq + 1, dtype=torch.long, device="meta")
        with Recorder(dims.tp) as rec, loss_context(model_):
            logits = model_(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
            loss.backward()
        _optimizer_state(opt)
        tb = model_.sharded_tensor_bytes()
        opt_bytes = sum(
            v.untyped_storage().nbytes() if v.dim() else 4
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        traffic_by = defaultdict(int)
        for (kind, _n, ranks), b in rec.bytes.items():
            traffic_by[(kind, dim_of.get(ranks, "other"))] += b
        engine_stats = model_.comm_stats()
    finally:
        fsdp_context.POOL_KEPT_BETWEEN_STEPS_ON = kept
        dist.destroy_process_group()
    return {
        "model": model,
        "world": world,
        "layout": layout,
        "shards": tb["shard"] + tb["grad_shard"],
        "grad_pool": tb["grad_pool"],
        "optimizer": opt_bytes,
        "traffic": {f"{k}/{d}": v for (k, d), v in sorted(traffic_by.items())},
        "engine_counters": {k: v for k, v in engine_stats.items() if k.endswith("_bytes")},
    }


def _optimizer_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step creates it (exp_avg, exp_avg_sq like the parameter, a scalar
    step); the arithmetic of the update cannot run on meta tensors, the allocation is what counts."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def predict_row(model: str, world: int, layout: str, seq: int = 2048, micro: int = 1) -> dict:
    job = job_from_config(job_config(model, world, layout, seq, micro))
    mem = memory(job)
    tr = traffic(job)
    by = defaultdict(int)
    for r in tr.rows:
        if r["dim"] != "tp" or _FunctionalCollectives.enabled:
            by[f"{r['collective']}/{r['dim']}"] += r["bytes"]
    return {
        "shards": mem.params + mem.grads,
        "grad_pool": mem.grad_pool,
        "optimizer": mem.optimizer,
        "traffic": dict(by),
    }


def compare(sim: dict, pred: dict) -> dict:
    """Relative error per quantity (0 = exact); traffic keys from either side."""
    err = {}
    for key in ("shards", "grad_pool", "optimizer"):
        a, b = sim[key], pred[key]
        err[key] = abs(a - b) / max(a, 1)
    keys = set(sim["traffic"]) | set(pred["traffic"])
    for k in keys:
        a, b = sim["traffic"].get(k, 0), pred["traffic"].get(k, 0)
        err[k] = abs(a - b) / max(a, 1)
    return err


def run(models, worlds, layouts, seq=2048, micro=1):
    rows = []
    for model in models:
        for world in worlds:
            for layout in layouts:
                if layout == "hybrid" and world <= 8:
                    continue  # one node: hybrid has nothing to replicate across
                t0 = time.time()
                sim = simulate_row(model, world, layout, seq, micro)
                pred = predict_row(model, world, layout, seq, micro)
                err = compare(sim, pred)
                rows.append(
                    {"sim": sim, "pred": pred, "err": err, "max_err": max(err.values()), "seconds": time.time() - t0}
                )
    return rows


def format_table(rows) -> str:
    gib = lambda b: b / 2**30
    lines = [
        (
            "| model | ranks | layout | shards+grads GiB sim / plan | optimizer GiB sim / plan | "
            "gather GiB/step sim / plan | reduce GiB/step sim / plan | all-reduce dp GiB/step sim / plan | "
            "all-reduce tp GiB/step sim / plan | max error |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pair(s, p, prefix):
        a = sum(v for k, v in s["traffic"].items() if k.startswith(prefix))
        b = sum(v for k, v in p["traffic"].items() if k.startswith(prefix))
        return f"{gib(a):.2f} / {gib(b):.2f}"

    for r in rows:
        s, p = r["sim"], r["pred"]
        lines.append(
            f"| {s['model']} | {s['world']} | {s['layout']} | "
            f"{gib(s['shards']):.2f} / {gib(p['shards']):.2f} | "
            f"{gib(s['optimizer']):.2f} / {gib(p['optimizer']):.2f} | {pair(s, p, 'all_gather')} | "
            f"{pair(s, p, 'reduce_scatter')} | {pair(s, p, 'all_reduce/dp')} | "
            f"{pair(s, p, 'all_reduce/tp')} | {100 * r['max_err']:.2f}% |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama_7b", "llama_70b"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[8, 64, 512, 1024])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    t0 = time.time()
    rows = run(args.models, args.worlds, args.layouts, args.seq)
    print(format_table(rows))
    worst = max(r["max_err"] for r in rows)
    print(
        f"\n{len(rows)} rows in {time.time() - t0:.0f} s; largest planner-vs-simulation difference "
        f"{100 * worst:.3f}% (bound {100 * TOLERANCE:.0f}%)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
