"""Float8 training (`parallelism.float8`): the model's linears become torchao's float8 linears, and
the engine gathers their weights as float8.

[Note: float8 training]
torchao's `Float8Linear` casts a linear's input, weight and output gradient to float8 (e4m3 for
the forward's operands; tensor-wise: one dynamic scale per tensor from its absmax, or row-wise:
one per row) and multiplies in float8 on GPUs with float8 tensor cores (H100/H200 and later). On
any other device (this CPU) the same casts run and the product is taken in fp32 (`emulate`), so
the numbers are those of float8 training and only the speed is not. Converted: every nn.Linear
whose dimensions are multiples of 16 (what the float8 matmul needs), except the output head (a
linear producing as many values as an embedding has rows: the logits, where float8 costs the
most accuracy), as torchtitan does. Parameter names do not change, so checkpoints cross float8
and full-precision runs both ways. Under a pipeline the whole model is converted before it is
cut into stages (framework/distributed/pipeline.py), so a stage holding the head without the
embedding still leaves the head alone.

The gather of the converted weights moves one byte per element (native engine:
`QuantizedCommPolicy(dtype="float8")`, [Note: float8 all-gather] in fsdp/zeropp.py; torch engine:
torchao's float8 all-gather for FSDP2), tensor-wise recipe only: a row-wise weight is cast per row
by the linear, so it is gathered in the param dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import nn

from framework.errors import UserInputError

RECIPES = ("tensorwise", "rowwise")


def _torchao_float8():
    """torchao.float8 (its import-time notices are silenced in framework/__init__.py)."""
    try:
        import torchao.float8 as f8
    except ImportError as e:
        raise UserInputError(
            f"parallelism.float8=true needs the torchao package ({e}); run `make venv` "
            "(requirements.lock pins it) or `pip install torchao==0.18.0`"
        ) from None
    return f8


def all_gather_in_float8(cfg) -> bool:
    """Whether the weights are gathered as float8 (`parallelism.float8_all_gather`, null: with the
    tensor-wise recipe, unless the shards are offloaded to the CPU or tp > 1)."""
    if not cfg.float8:
        return False
    if cfg.float8_all_gather is None:  # tp > 1: see [Note: float8 under tensor parallelism]
        return cfg.float8_recipe == "tensorwise" and not cfg.cpu_offload and cfg.tp == 1
    return bool(cfg.float8_all_gather)


def convertible(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The float8 module filter: linears with dims in multiples of 16, not the output head."""
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if module.in_features % 16 or module.out_features % 16:
            return False
        return module.out_features not in vocab

    return keep


# [Note: LoRA over a float8 base]
# LoRA adds its adapters to the plain model first; conversion then replaces each adapted linear by
# a float8 one holding the same (frozen) weight, and the adapter moves to it (`move_adapter`): the
# base product is float8 (input, weight and output gradient cast as above), the adapter's two thin
# products stay in the adapter's own precision (fp32), reading the layer's full-precision input, as
# a LoRA over a quantized base does. Under tensor parallelism the adapter is split as its base
# ([Note: adapters under tensor parallelism] in framework/peft/lora.py).


# [Note: float8 under tensor parallelism]
# With parallelism.tp > 1 the linears are converted before the plan is applied, so the plan's
# torch styles split torchao's float8 linears (their weight a DTensor): the linear casts its input,
# its weight and its output's gradient as DTensors, each tensor-wise with the scale from the absmax
# over the *whole* tensor (DTensor's amax reduces over the tp ranks: one all-reduce of a scalar
# per cast). Every rank casts with the scale one process computes, so the float8 values are one
# process's and only the sums' order differs (a row-wise layer's partial products). torchao's
# float8 styles would cast before the input's redistribution, to gather float8 under sequence
# parallelism: a GPU saving (gloo has no float8 collectives), not taken here; our collectives move
# full-precision values. The row-wise recipe likewise: a row-wise layer's per-row scales span the
# tp ranks' columns, and DTensor's amax over that dim reduces across them. The engine's float8
# gather stays off under tp: its scale is agreed over the dp ranks only, so the gathered float8
# values would not be those the linear casts with the whole-tensor scale.


def is_float8_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def apply_float8(model: nn.Module, cfg, device_type: str, torchao_gathers: bool) -> int:
    """Convert the model's linears in place (before sharding); returns how many were converted."""
    f8 = _torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(cfg.float8_recipe)
    changes = {"emulate": device_type != "cuda"}  # see [Note: float8 training]
    if torchao_gathers and all_gather_in_float8(cfg):  # the engine gathers torchao's float8 weights
        changes["enable_fsdp_float8_all_gather"] = True
    config = dataclasses.replace(config, **changes)
    before = sum(1 for m in model.modules() if is_float8_linear(m))
    adapted = {name: m for name, m in model.named_modules() if "lora_a" in m._parameters}  # LoRA's layers
    f8.convert_to_float8_training(model, config=config, module_filter_fn=convertible(model))
    for name, old in adapted.items():  # [Note: LoRA over a float8 base]
        new = model.get_submodule(name)
        if new is not old:
            from framework.peft.lora import move_adapter

            move_adapter(old, new)
    converted = sum(1 for m in model.modules() if is_float8_linear(m)) - before
    if converted == 0:
        raise UserInputError(
            "parallelism.float8=true: the model has no linear layer float8 can take (dimensions in "
            "multiples of 16, not the output head); set parallelism.float8=false"
        )
    return converted
