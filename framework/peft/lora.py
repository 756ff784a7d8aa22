"""LoRA: low-rank adapters added to chosen linear layers of a frozen model.

For a target layer y = x W^T (+ b) the adapter adds (alpha / rank) * dropout(x) A^T B^T, with
A (rank x in) drawn like a linear layer's weight and B (out x rank) zero, so training starts from
exactly the base model. Only A and B are trained; every other parameter is frozen.

[Note: adapters live on the layer they adapt]
The adapters are two parameters registered on the target module itself (`<layer>.lora_a`,
`<layer>.lora_b`) and added to its output by a forward hook; the module is not replaced. So:
the base parameters keep their names (checkpoints, Hugging Face import/export and tensor names
are unchanged), the adapters belong to the same sharding unit as the weight they adapt (our
engine and torch's gather them together with the block), and adapters-only checkpoints are the
state-dict entries whose name contains `.lora_`. Our own adapter rather than the `peft` library:
`peft` wraps every target in a new module (renaming `q_proj.weight` to
`q_proj.base_layer.weight`), which our import/export name maps and the per-block sharding would
all have to know about; this file is the whole feature and works the same for our Llama and
Hugging Face models.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from framework.errors import UserInputError

ADAPTER_MARKER = ".lora_"


def _shape_of(module: nn.Module):
    """(in_features, out_features, weight is stored transposed) of a linear-like module, or None.
    Hugging Face's GPT-2 `Conv1D` stores its weight as (in, out)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.shape[0], module.weight.shape[1], True
    return None


def _lora_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    if getattr(module, "lora_off", False):  # adapters_disabled(): the base layer alone
        return output
    x = args[0]
    if module.training and module.lora_dropout > 0:
        x = F.dropout(x, module.lora_dropout)
    update = F.linear(F.linear(x.to(module.lora_a.dtype), module.lora_a), module.lora_b)
    return output + (module.lora_scale * update).to(output.dtype)


def target_layers(
    model: nn.Module, targets: Iterable[str], alias: Callable[[str], str] | None = None
) -> dict[str, nn.Module]:
    """{module name: module} of the linear layers whose last name component is a target. `alias`
    maps a module name to another spelling to match as well (our Llama's `attention.wq` answers
    to `q_proj`, its Hugging Face name), so one target list serves both model kinds."""
    wanted = set(targets)
    found = {}
    for name, module in model.named_modules():
        if not name or _shape_of(module) is None:
            continue
        names = {name.rsplit(".", 1)[-1]}
        if alias is not None:
            other = alias(name)
            if other:
                names.add(other.rsplit(".", 1)[-1])
        if names & wanted:
            found[name] = module
    return found


def apply_lora(
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    dropout: float = 0.0,
    alias: Callable[[str], str] | None = None,
    seed: int | None = None,
) -> list[str]:
    """Freeze every parameter of `model`, add adapters to the target layers, return their names.
    Call it on the plain model, before parallelism is applied."""
    layers = target_layers(model, targets, alias)
    if not layers:
        available = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _shape_of(m)})
        raise UserInputError(
            f"peft.lora.targets={list(targets)} matches no linear layer of this model; "
            f"its linear layers are named {', '.join(available)}"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for module in layers.values():
        in_features, out_features, _ = _shape_of(module)
        weight = module.weight
        module.lora_a = nn.Parameter(torch.empty(rank, in_features, device=weight.device, dtype=torch.float32))
        module.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=weight.device, dtype=torch.float32))
        module.lora_scale = alpha / rank
        module.lora_dropout = dropout
        module.lora_hook = module.register_forward_hook(_lora_hook)
    reset_lora(model, seed)
    return sorted(layers)


@torch.no_grad()
def reset_lora(model: nn.Module, seed: int | None = None) -> None:
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (a linear layer's default), B = 0: the adapted model starts
    equal to the base model. Also after `to_empty` on a model built on the meta device."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for module in model.modules():
        a = getattr(module, "lora_a", None)
        if not isinstance(a, torch.Tensor) or _shape_of(module) is None:
            continue
        bound = 1.0 / math.sqrt(_shape_of(module)[0])  # in_features (the module keeps it when sharded)
        if gen is not None and a.device.type == "cpu" and a.dim() == 2:
            a.copy_(torch.rand(a.shape, generator=gen) * 2 * bound - bound)
        else:
            nn.init.uniform_(a, -bound, bound)
        module.lora_b.zero_()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapted layer of `model` computes its base layer alone: the model
    as it was before LoRA (DPO's reference without a second copy)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "lora_a", None), torch.Tensor)]
    for module in layers:
        module.lora_off = True
    try:
        yield
    finally:
        for module in layers:
            module.lora_off = False


def move_adapter(old: nn.Module, new: nn.Module) -> None:
    """Give `new` the adapter of `old`, the layer it replaces (float8 conversion swaps each linear
    for a float8 one holding the same weight): the same A and B parameters, scale, dropout and hook."""
    new.register_parameter("lora_a", old._parameters.pop("lora_a"))
    new.register_parameter("lora_b", old._parameters.pop("lora_b"))
    new.lora_scale, new.lora_dropout = old.lora_scale, old.lora_dropout
    old.lora_hook.remove()
    new.lora_hook = new.register_forward_hook(_lora_hook)


def take_adapters(model: nn.Module) -> dict[nn.Module, tuple[nn.Parameter, nn.Parameter]]:
    """Remove every adapter pair from its layer and return them ({layer: (A, B)}): tensor
    parallelism splits a layer's own parameters by its style, then `split_adapters` puts the
    pair back split to match (see [Note: adapters under tensor parallelism])."""
    taken = {}
    for module in model.modules():
        if isinstance(module._parameters.get("lora_a"), torch.Tensor):
            taken[module] = (module._parameters.pop("lora_a"), module._parameters.pop("lora_b"))
    return taken


# [Note: adapters under tensor parallelism]
# The adapter is a second, thin linear beside its base, y = W x + s B (A x): A (rank x in) reads
# the base's input, B (out x rank) writes into its output. So A is split like the base's input
# and B like its output:
#   column-wise base (W split on out, input whole): A whole on every rank, B split on its rows;
#     A x is computed whole, B's rows give this rank's output columns: no communication.
#   row-wise base (W split on in, input split on features): A split on its columns, B whole;
#     A x is a partial sum per rank (rank x tokens values), and B (A x) stays a partial sum that
#     the base's own reduction (all-reduce or reduce-scatter) adds up with W x: no extra
#     collective either.
# DTensor carries the placements through the hook's two linears; a whole (Replicate) A or B gets
# the sum of the ranks' gradient contributions as its gradient, as the base's replicated bias
# does. Layers the plan does not split keep plain adapters.


def split_adapters(taken: dict[nn.Module, tuple[nn.Parameter, nn.Parameter]], mesh) -> None:
    """Register each adapter pair from `take_adapters` on its layer again, as DTensors on `mesh`
    (the tensor-parallel mesh) split to match the layer's weight: [Note: adapters under tensor
    parallelism]."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    for module, (a, b) in taken.items():
        weight = module.weight
        if isinstance(weight, DTensor):
            if _shape_of(module)[2]:
                raise UserInputError(
                    f"peft.lora with parallelism.tp > 1: {type(module).__name__} layers (weight stored "
                    "transposed) are not split for tensor parallelism; set parallelism.tp=1"
                )
            (placement,) = weight.placements
            if placement == Shard(0):  # column-wise: output features split
                a_at, b_at = Replicate(), Shard(0)
            elif placement == Shard(1):  # row-wise: input features split
                a_at, b_at = Shard(1), Replicate()
            else:
                a_at = b_at = Replicate()
            # Every rank holds the same values (same seed): each keeps its own piece, no broadcast.
            a = nn.Parameter(distribute_tensor(a.detach(), mesh, [a_at], src_data_rank=None), a.requires_grad)
            b = nn.Parameter(distribute_tensor(b.detach(), mesh, [b_at], src_data_rank=None), b.requires_grad)
        module.register_parameter("lora_a", a)
        module.register_parameter("lora_b", b)


def is_adapter(name: str) -> bool:
    return ADAPTER_MARKER in name or name.startswith("lora_")


def adapter_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Only the adapters of a (sharded or full) model state dict: what a LoRA checkpoint holds."""
    return {k: v for k, v in state_dict.items() if is_adapter(k)}


@torch.no_grad()
def merged_state(
    state_dict: dict[str, torch.Tensor], scale: float, transposed: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """A full (unsharded) state dict with every adapter folded into its layer's weight,
    W + scale * B A, and the adapter entries dropped: a plain model's state dict. `transposed`
    names the layers whose weight is stored (in, out), as GPT-2's Conv1D."""
    out = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    flipped = set(transposed)
    for key, lora_a in state_dict.items():
        if not key.endswith(".lora_a"):
            continue
        layer = key[: -len(".lora_a")]
        delta = scale * (state_dict[layer + ".lora_b"].float() @ lora_a.float())
        weight = out[layer + ".weight"]
        out[layer + ".weight"] = (weight.float() + (delta.T if layer in flipped else delta)).to(weight.dtype)
    return out


def merge_lora_(model: nn.Module) -> None:
    """Fold the adapters of a plain (unsharded) model into its weights and remove them."""
    for module in list(model.modules()):
        a = getattr(module, "lora_a", None)
        if not isinstance(a, torch.Tensor):
            continue
        _, _, transposed = _shape_of(module)
        with torch.no_grad():
            delta = module.lora_scale * (module.lora_b.float() @ a.float())
            module.weight.add_((delta.T if transposed else delta).to(module.weight.dtype))
        module.lora_hook.remove()
        del module.lora_a, module.lora_b, module.lora_hook


def trainable_summary(model: nn.Module) -> str:
    seen = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    train = sum(p.numel() for p in seen.values() if p.requires_grad)
    return f"{train:,} trainable of {total:,} parameters ({100.0 * train / max(total, 1):.2f}%)"


@torch.no_grad()
def merged_sharded_state(state_dict: dict, scale: float) -> dict:
    """`merged_state` for a sharded state dict (dim-0 `Shard(0)` DTensors, either engine): each
    rank folds its rows of B A into its rows of W; A (rank x in, small) is gathered whole. Every
    rank must call it (the gather is a collective). Plain tensors are merged as they are."""
    out = {k: v for k, v in state_dict.items() if not is_adapter(k)}
    for key in sorted(state_dict):
        if not key.endswith(".lora_a"):
            continue
        layer = key[: -len(".lora_a")]
        a, b, weight = state_dict[key], state_dict[layer + ".lora_b"], out[layer + ".weight"]
        if not hasattr(weight, "to_local"):
            out[layer + ".weight"] = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
            continue
        from torch.distributed.tensor import DTensor

        a_full = a.full_tensor().float()
        local_w, local_b = weight.to_local(), b.to_local()
        if local_w.shape == (local_b.shape[0], a_full.shape[1]) and b.placements == weight.placements:
            # W and B split alike on their rows (out_features): this rank's rows of B A.
            delta = local_b.float() @ a_full
        else:
            # Split otherwise (tensor parallel: a row-wise W split on its columns, B whole on the
            # tp ranks): B A of this one layer whole, then this rank's piece of it, cut as W is.
            from torch.distributed.tensor import distribute_tensor

            whole = b.full_tensor().float() @ a_full
            delta = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        merged = (local_w.float() + scale * delta).to(local_w.dtype)
        out[layer + ".weight"] = DTensor.from_local(
            merged, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride()
        )
    return out
