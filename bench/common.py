"""Shared pieces of the benchmarks: GPT-like models, starting ranks on gloo or NCCL, counting the
bytes peers put on the wire, and measuring a step's peak memory.

The same code runs on CPU (gloo, one compute thread per rank) and on CUDA (NCCL, one GPU per rank):
the ranks are started as `main.py` starts its own (`framework.local_ranks.run_local`), which picks by
what the machine has. Nothing here comes from tests/.
"""

from __future__ import annotations

import inspect
import os
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.local_ranks import run_local
from framework.profiling import peak_delta_bytes  # noqa: F401  (the benchmarks' peak reader)

SIZES = {  # name: (vocab, d_model, layers, heads, seq, micro_batch per rank)
    "tiny": (1024, 128, 2, 4, 64, 4),
    "25m": (16384, 512, 6, 8, 128, 2),  # 27.4M parameters (tied embedding)
    "125m": (50304, 768, 12, 12, 128, 2),  # GPT-2 small: 124M parameters
    "1b": (32000, 2048, 18, 16, 1024, 4),  # 0.97B; for bench/engine.py --device cuda (bench/gpu_check.sh)
}


class Block(nn.Module):
    """A pre-LN GPT-2 block: causal attention, then a GELU MLP, each added to the residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's shape at benchmark sizes: token + position embeddings, pre-LN blocks, a final norm
    and a head tied to the embedding (both users in the root unit), with GPT-2's initialisation.
    The engine tests' TinyGPT (tests/distributed/engine_models.py) has the same layout."""

    def __init__(self, vocab, d, layers, heads, seq):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases. torch's defaults (an N(0, 1)
        # embedding, tied here to the head) give logits with a standard deviation of ~20, whose
        # softmax gradients underflow to subnormal floats within a few steps; x86 computes with
        # those ~7x slower, so every engine's backward slowed down ~7x after ~8 steps.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def build_gpt(size: str, seed: int = 0) -> GPT:
    vocab, d, layers, heads, seq, _ = SIZES[size]
    torch.manual_seed(seed)
    return GPT(vocab, d, layers, heads, seq)


def gpt_params(size: str) -> int:
    """Parameters of the benchmark GPT of `size` (counted on the meta device: nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_gpt(size).parameters())


def flops_per_token(size: str) -> float:
    """6 x non-embedding parameters + attention (12 x layers x d x seq), as the trainer counts."""
    _vocab, d, layers, _heads, seq, _ = SIZES[size]
    non_embedding = layers * (12 * d * d + 13 * d) + 2 * d
    return 6.0 * non_embedding + 12.0 * layers * d * seq


def batch(size: str, step: int, dp_rank: int, device) -> torch.Tensor:
    vocab, _d, _layers, _heads, seq, mb = SIZES[size]
    g = torch.Generator().manual_seed(step * 1000 + dp_rank)
    return torch.randint(0, vocab, (mb, seq + 1), generator=g).to(device)


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), idx[:, 1:].reshape(-1))


# ------------------------------------------------------------------ engines
LR = 1e-4


class Built:
    """One engine ready to step: `step(idx)` runs forward, backward and the optimizer."""

    def __init__(self, name, model, opt=None, ds=None):
        self.name, self.model, self.opt, self.ds = name, model, opt, ds

    def step(self, idx, zero_grad: bool = True):
        if self.ds is not None:
            loss = loss_of(self.ds(idx[:, :-1]), idx)
            self.ds.backward(loss)
            self.ds.step()
            return loss
        loss = loss_of(self.model(idx[:, :-1]), idx)
        loss.backward()
        self.opt.step()
        if zero_grad:
            self.opt.zero_grad(set_to_none=True)
        return loss

    def comm(self):
        return self.model.comm_stats() if hasattr(self.model, "comm_stats") else None


def _ds_config(stage: int, size: str) -> dict:
    mb = SIZES[size][5]
    return {
        "train_micro_batch_size_per_gpu": mb,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        # Buckets sized for these models (50M elements, 200 MB fp32): DeepSpeed's defaults (500M
        # elements) target billion-parameter models and would allocate 2 GB per bucket per rank here.
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "allgather_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(name: str, size: str, device, world: int, *, foreach: bool | None = None, bf16: bool = False) -> Built:
    """The benchmark GPT of `size` under engine `name`, every block one unit and the root kept
    gathered after forward (as `parallelize` and torchtitan do), with AdamW. Names: ours_full (or
    ours), ours_gloo (ours over gloo's TCP on process groups of its own), ours_grad_op,
    ours_hybrid, ours_int8, ours_rows, ours_params (shard boundaries), fsdp2, ddp, ds_zero2,
    ds_zero3; a "+compile" suffix compiles each block. `foreach`: AdamW's (None: torch's choice
    on CUDA, off on CPU); `bf16`: bf16 compute with fp32 shards and reduction (ours and fsdp2)."""
    compile_blocks = name.endswith("+compile")
    base = name.removesuffix("+compile")
    model = build_gpt(size).to(device)  # the same initial weights on every device
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    if base.startswith("ours") or base == "fsdp2":
        if base == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        else:
            from framework.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = None
        if base == "ours_hybrid" and world >= 2:
            mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        if base == "ours_gloo":
            # A transport is chosen once per process group ([Note: one transport per group]): this
            # variant gets groups of its own (a new group under a mesh of another name), else it
            # would share the default mesh's groups (the world's), and their transport, with `ours`.
            group = dist.new_group(list(range(dist.get_world_size())))
            mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=("dp_gloo",))
        kw = {}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif base == "ours_int8":
            kw["mp_policy"] = MixedPrecisionPolicy(quantized_comm=True)
        if base in ("ours_rows", "ours_params"):  # [Note: shard boundaries]
            kw["shard_boundary"] = base.removeprefix("ours_")
        if mesh is not None:
            kw["mesh"] = mesh
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=base != "ours_grad_op", **kw)
        fully_shard(model, reshard_after_forward=False, **kw)
    elif base == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, gradient_as_bucket_view=True, device_ids=[device.index] if device.type == "cuda" else None)
    elif base.startswith("ds_zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=_ds_config(int(base[-1]), size)
        )
        return Built(name, engine, ds=engine)
    else:
        raise ValueError(f"unknown engine {name!r}")
    if foreach is None:
        foreach = None if device.type == "cuda" else False
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
    return Built(name, model, opt)


# ------------------------------------------------------------------ ranks
def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def _with_device(rank: int, world: int, fn: Callable, *args) -> Any:
    """One rank of `spawn`: in the process group run_local made (and on its GPU, on CUDA)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collective names
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return fn(rank, world, device, *args)


def spawn(fn: Callable, world: int, args: tuple = (), timeout_s: float = 3600) -> list:
    """Run `fn(rank, world, device, *args)` on `world` ranks; return the per-rank results. The
    ranks are started as `main.py` starts its own (`framework.local_ranks.run_local`): one compute
    thread each on CPU, gloo there, NCCL beside gloo on CUDA with one GPU per rank, with the NCCL
    settings `main.py`'s ranks run with ([Note: a hung rank on NCCL] in framework/runtime.py)."""
    return run_local(_with_device, world, args=(fn, *args), device="auto", timeout_s=timeout_s)


# ------------------------------------------------------------------ bytes on the wire
class WireCounter:
    """Counts the bytes this rank moves through torch.distributed's collectives (what FSDP2 and
    DeepSpeed call; DDP's reducer calls the backend from C++ and is not seen), with the same
    conventions as our engine's counters: an all-gather the bytes received, a reduce-scatter or
    all-to-all the bytes sent, an all-reduce the ring volume 2 (n-1)/n x bytes, a reduce (n-1)/n.

    The wrappers replace the functions in `torch.distributed.distributed_c10d`'s namespace, where
    the deprecated spellings (`all_gather_into_tensor`, `_all_gather_base`, `reduce_scatter_tensor`)
    forward to `all_gather_single` / `reduce_scatter_single`: a caller that kept a reference to
    any of them (DeepSpeed does) is counted once, at the function that does the work."""

    def __init__(self) -> None:
        self.bytes = 0
        self._orig: dict = {}

    def install(self) -> "WireCounter":
        from torch.distributed import distributed_c10d as c10d

        def nb(t):
            return t.numel() * t.element_size()

        rules = {
            "all_gather_single": lambda a, n: (n - 1) * nb(a["input_tensor"]),
            "reduce_scatter_single": lambda a, n: (n - 1) * nb(a["input"]) // n,
            "all_reduce": lambda a, n: 2 * (n - 1) * nb(a["tensor"]) // n,
            "all_reduce_coalesced": lambda a, n: 2 * (n - 1) * sum(nb(t) for t in a["tensors"]) // n,
            "all_to_all_single": lambda a, n: (n - 1) * nb(a["input"]) // n,
            "all_gather": lambda a, n: (n - 1) * nb(a["tensor"]),
            "reduce_scatter": lambda a, n: (n - 1) * nb(a["output"]),
            "reduce": lambda a, n: (n - 1) * nb(a["tensor"]) // n,
        }
        for name, rule in rules.items():
            if not hasattr(c10d, name) or name in self._orig:
                continue
            orig = getattr(c10d, name)
            sig = inspect.signature(orig)

            def counted(*args, _orig=orig, _sig=sig, _rule=rule, **kwargs):
                bound = _sig.bind(*args, **kwargs)
                n = dist.get_world_size(bound.arguments.get("group"))
                if n > 1:
                    self.bytes += _rule(bound.arguments, n)
                return _orig(*args, **kwargs)

            self._orig[name] = orig
            setattr(c10d, name, counted)
            if getattr(dist, name, None) is orig:
                setattr(dist, name, counted)
        return self


# ------------------------------------------------------------------ memory
def rss_mb(field: str = "VmHWM") -> float:
    """This process's resident memory in MiB from /proc/self/status: the high-water mark (VmHWM,
    since the last `reset_rss_peak`) or the current VmRSS; nan where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_rss_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5), so a phase's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def live_tensor_bytes(model: nn.Module, opt: Any, extra: int = 0) -> int:
    """Parameters + gradients + optimizer state held by this rank (local shards of DTensors),
    plus `extra` (engine buffers)."""

    def local(t):
        return t._local_tensor if hasattr(t, "_local_tensor") else t

    seen, total = set(), extra
    for p in model.parameters():
        for t in (p, p.grad):
            if t is None:
                continue
            st = local(t).untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    states = opt.state.values() if hasattr(opt, "state") else []
    for st in states:
        for v in st.values():
            if isinstance(v, torch.Tensor) and local(v).untyped_storage().data_ptr() not in seen:
                seen.add(local(v).untyped_storage().data_ptr())
                total += local(v).untyped_storage().nbytes()
    return total
