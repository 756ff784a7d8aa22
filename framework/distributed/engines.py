"""The sharding engines, described once: everything the framework asks of an engine, per engine.

`parallelism.engine` names one of `ENGINES`. The rest of the framework (parallelize, the trainer,
the checkpoint code) calls `engine_of(name)` and never compares engine names:

    engine = engine_of(cfg.parallelism.engine)
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = engine.api()
    norm = engine.clip_grad_norm(model, max_norm)
    model_sd, optim_sd = engine.get_state_dicts(model, optimizer)

Adding an engine is one more `ShardingEngine` subclass and one entry in `ENGINES` here (plus its
name among the config's `Engine` choices, which the config checks without importing torch).
Each engine imports its implementation only when used, so importing this module is cheap.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

StateDicts = Tuple[Dict[str, Any], Dict[str, Any]]


class ShardingEngine:
    """One engine. Subclasses fill in every method; the defaults state what "no counters" means."""

    name: str = ""

    def api(self) -> Tuple[Callable, type, type]:
        """(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy), with FSDP2's signatures."""
        raise NotImplementedError

    def configure(self, cfg) -> None:
        """Engine-wide settings of the `parallelism` section, applied before the first `fully_shard`."""

    # The float8 all-gather ([Note: float8 training] in float8.py): made by torchao's weight tensor
    # subclass (an engine that calls its FSDP2 hooks), or by the engine from `float8_gather_kwargs`.
    float8_gather_by_torchao: bool = False

    def float8_gather_kwargs(self, is_float8: Callable[[nn.Module], bool]) -> Dict[str, Any]:
        """Extra `fully_shard` arguments that gather the weights of `is_float8` modules as float8."""
        return {}

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global gradient norm over every shard on every rank; clips in place when max_norm > 0."""
        raise NotImplementedError

    def optimizer_step(self, optimizer) -> None:
        """The optimizer's step, as this engine runs it fastest with the same result."""
        optimizer.step()

    def get_state_dicts(self, model: nn.Module, optimizer) -> StateDicts:
        """(model_sd, optim_sd): sharded DTensor state dicts keyed by parameter name, in the format
        of `torch.distributed.checkpoint.state_dict.get_state_dict`, so checkpoints cross engines."""
        raise NotImplementedError

    def set_state_dicts(self, model: nn.Module, optimizer, model_sd, optim_sd) -> None:
        raise NotImplementedError

    def get_model_state_dict(self, model: nn.Module) -> Dict[str, Any]:
        """`get_state_dicts`'s model_sd alone, for a job with no optimizer (generate, evaluate)."""
        return model.state_dict()

    def set_model_state_dict(self, model: nn.Module, model_sd) -> None:
        model.load_state_dict(model_sd)

    def step_counters(self, model: nn.Module) -> Dict[str, float]:
        """Communication since `reset_counters`: exposed_comm_s, comm_bytes ({} if not counted)."""
        return {}

    def reset_counters(self, model: nn.Module) -> None:
        pass

    def shards(self, model: nn.Module) -> bool:
        """Whether this engine sharded `model` (its root)."""
        return False

    def register_forward_method(self, model: nn.Module, method_name: str) -> bool:
        """`register_fsdp_forward_method(model, method_name)` for a method run under no_grad (generation).
        True when the forwards inside it still communicate (every rank must then run as many)."""
        raise NotImplementedError


class NativeEngine(ShardingEngine):
    """Our engine (framework/distributed/fsdp): byte and exposed-time counters per unit."""

    name = "native"

    def api(self):
        from framework.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy

    def configure(self, cfg):
        from framework.distributed.fsdp import set_host_transport

        set_host_transport(getattr(cfg.host_transport, "value", cfg.host_transport))

    def float8_gather_kwargs(self, is_float8):
        from framework.distributed.fsdp import QuantizedCommPolicy

        return {"comm_policy": QuantizedCommPolicy(dtype="float8", float8_filter=is_float8)}

    def clip_grad_norm(self, model, max_norm):
        from framework.distributed.fsdp import clip_grad_norm_

        return clip_grad_norm_(_grads_of(model), _limit(max_norm))

    def optimizer_step(self, optimizer):
        from framework.distributed.fsdp import optimizer_step  # [Note: the optimizer step on plain local data]

        optimizer_step(optimizer)

    def get_state_dicts(self, model, optimizer):
        from framework.distributed.fsdp import get_state_dicts

        return get_state_dicts(model, optimizer)

    def set_state_dicts(self, model, optimizer, model_sd, optim_sd):
        from framework.distributed.fsdp import set_state_dicts

        set_state_dicts(model, optimizer, model_sd, optim_sd)

    def step_counters(self, model):
        comm = model.comm_stats()
        moved = sum(comm[k] for k in ("allgather_bytes", "reduce_scatter_bytes", "allreduce_bytes", "alltoall_bytes"))
        from framework.distributed.expert_parallel import AllToAllCounter

        moved += AllToAllCounter.bytes_sent  # the model's own all-to-alls (parallelism.ep, parallelism.cp)
        # gather_bytes: the parameter all-gathers alone (float8 gathers move 1 byte per element)
        return {"exposed_comm_s": comm["exposed_comm_s"], "comm_bytes": moved, "gather_bytes": comm["allgather_bytes"]}

    def reset_counters(self, model):
        from framework.distributed.expert_parallel import AllToAllCounter

        model.reset_comm_stats()
        AllToAllCounter.reset()

    def shards(self, model):
        return getattr(model, "_fsdp_unit", None) is not None

    def register_forward_method(self, model, method_name):
        from framework.distributed.fsdp import register_fsdp_forward_method

        # Gathered once for the call (see its docstring): the forwards inside gather nothing.
        register_fsdp_forward_method(model, method_name, gather_once=True)
        return False


class TorchEngine(ShardingEngine):
    """torch's `fully_shard` (FSDP2), for side-by-side comparison; it keeps no counters."""

    name = "torch"
    float8_gather_by_torchao = True  # torchao's float8 weights implement FSDP2's all-gather hooks

    def api(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy

    def clip_grad_norm(self, model, max_norm):
        # Tensor parallel leaves DTensor gradients on two meshes (tp-split weights on (dp, tp), plain
        # weights such as the norms' on dp only), which one foreach norm cannot mix: norm per mesh,
        # then combine the global per-mesh norms.
        # A pipeline's part (framework/distributed/pipeline.py) holds some stages: its `norm_group`
        # holds the others, and `norm_copies` names parameters another rank of it holds too.
        copies = getattr(model, "norm_copies", {})
        by_mesh: dict = {}
        for p in _grads_of(model):
            by_mesh.setdefault((getattr(p.grad, "device_mesh", None), copies.get(id(p), 1)), []).append(p)
        norms = [torch.nn.utils.get_total_norm([p.grad for p in group], 2.0) for group in by_mesh.values()]
        norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
        norms = [n / c**0.5 if c > 1 else n for n, (_, c) in zip(norms, by_mesh)]
        norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        if getattr(model, "norm_group", None) is not None:
            import torch.distributed as dist

            square = norm.square()
            dist.all_reduce(square, group=model.norm_group)
            norm = square.sqrt()
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, _limit(max_norm), norm)
        return norm

    def get_state_dicts(self, model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(model, optimizer)

    def set_state_dicts(self, model, optimizer, model_sd, optim_sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def get_model_state_dict(self, model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model)

    def set_model_state_dict(self, model, model_sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, model_sd)

    def shards(self, model):
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule) and not NativeEngine().shards(model)

    def register_forward_method(self, model, method_name):
        from torch.distributed.fsdp import register_fsdp_forward_method

        # FSDP2 gathers the root for the call and each block at each forward inside it.
        register_fsdp_forward_method(model, method_name)
        return True


ENGINES: Dict[str, ShardingEngine] = {engine.name: engine for engine in (NativeEngine(), TorchEngine())}


def engine_of(name) -> ShardingEngine:
    """The engine `parallelism.engine` names (a config `Engine` or its string value)."""
    return ENGINES[getattr(name, "value", name)]


def engine_sharding(model: nn.Module) -> ShardingEngine | None:
    """The engine that sharded `model`, or None for a plain module."""
    return next((engine for engine in ENGINES.values() if engine.shards(model)), None)


def _grads_of(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.grad is not None]


def _limit(max_norm: float) -> float:
    return max_norm if max_norm > 0 else float("inf")  # 0: measure the norm, clip nothing
