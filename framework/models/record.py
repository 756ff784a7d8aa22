"""A model family's record: everything the rest of the framework needs to know about a model
(`ModelFamily`), and the state-dict adapter it may carry for Hugging Face export and import.

Each family folder builds its record in its `family.py`; `framework/models/registry.py` finds it
through the family list (`framework/models/families.py`) and looks it up by `model.name`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from framework.config.schema import ModelConfig
from framework.models.args import parse_args
from framework.models.tasks import Task, get_task


class StateDictAdapter(Protocol):
    """Our state-dict names <-> Hugging Face names, and the Hugging Face `config.json`.

    Used by `framework/checkpoint/hf.py` for `checkpoint.export_safetensors` and
    `checkpoint.init_from`; each family keeps its own next to its model."""

    def to_hf(self, name: str) -> str | None:
        """The Hugging Face name of our state-dict entry; None: not written (e.g. a tied copy)."""

    def from_hf_fallback(self, name: str) -> str | None:
        """Another Hugging Face name to read our entry from when `to_hf(name)` is absent (a tied
        head stored once as the embedding), or None."""

    def hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        """The `config.json` an export carries."""

    def check_hf_config(self, hf: dict, cfg: ModelConfig, where: str) -> None:
        """Refuse (UserInputError, one line naming the field) a `config.json` that computes
        differently from the model this job builds."""

    # Optional: `ignorable(key) -> bool` (Hugging Face names a checkpoint may hold that the model
    # does not read, e.g. buffers transformers ignores on load) and `write_extras(out_dir, tokenizer, cfg)` (tokenizer
    # files, generation config written next to an export).


def _default_init(model: nn.Module, seed: int | None) -> None:
    """Re-run each module's own `reset_parameters` under `seed` (None: the current RNG state)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


def _count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() already skips tied duplicates


def _default_flops(model: nn.Module, seq_len: int) -> float:
    """6 x parameters per trained token: the dense-matmul estimate, without attention's share."""
    return 6.0 * _count_params(model)


@dataclass(frozen=True)
class ModelFamily:
    names: tuple  # the model.name values this family builds (the conf/model presets)
    build: Callable[[ModelConfig, object], nn.Module]  # (cfg, device) -> plain module
    blocks: Callable[[nn.Module], list[nn.Module]]  # sharding units in forward order
    task: Callable[[ModelConfig], Task] = lambda cfg: get_task("causal_lm")
    init_weights: Callable[[nn.Module, int | None], None] = _default_init
    # {module name: ParallelStyle} for tensor parallelism, or None: parallelism.tp > 1 is refused.
    tp_plan: Callable[[nn.Module, bool], dict] | None = None
    # Modules recomputed in backward by parallelism.activation_checkpointing; None: the blocks.
    checkpoint_targets: Callable[[nn.Module], list[nn.Module]] | None = None
    # (cfg) -> the state-dict adapter of that configuration; None: Hugging Face export/import refused.
    adapter: Callable[[ModelConfig], StateDictAdapter] | None = None
    embedding_name: str | None = None  # state-dict key whose rows are the vocabulary
    num_params: Callable[[nn.Module], int] = _count_params
    flops_per_token: Callable[[nn.Module, int], float] = _default_flops
    # Classes of a classification task (data=synthetic draws labels below it).
    num_labels: Callable[[ModelConfig], int] = lambda cfg: cfg.num_labels if cfg.num_labels > 0 else 2
    # The vocabulary size before the data is built (data=synthetic draws tokens below it); <= 0:
    # the data's tokenizer decides it, and `with_vocab_size` gives the config the model is built with.
    vocab_size: Callable[[ModelConfig], int] = lambda cfg: 0
    with_vocab_size: Callable[[ModelConfig, int], ModelConfig] = lambda cfg, vocab_size: cfg
    # Pipeline parallelism (framework/distributed/pipeline.py): (model, start, end, first, last) ->
    # the module running blocks [start, end) (with the embedding if first, the head if last) under
    # the model's own names, and (model, pp) -> None refusing what a pipeline of it cannot do.
    # None: parallelism.pp > 1 is refused.
    pipeline_stage: Callable[[nn.Module, int, int, bool, bool], nn.Module] | None = None
    check_pipeline: Callable[[nn.Module, int], None] = lambda model, pp: None
    # Context parallelism (framework/distributed/context_parallel.py): (model, cp) -> None readying a
    # model whose attention modules are not ours for the sequence exchange over cp ranks (marking
    # them with `sequence_exchange`); None: its attention modules already have one (our Llama's).
    context_parallel: Callable[[nn.Module, int], None] | None = None
    # Refuses (UserInputError) a configuration this family cannot build; run before any rank starts.
    check: Callable[[ModelConfig], None] = lambda cfg: None
    # A directory whose weights initialise the model at the start (model=hf model.path); "" none.
    weights_dir: Callable[[ModelConfig], str] = lambda cfg: ""

    # The family's own typed arguments (`model.args`), a dataclass whose fields have defaults
    # (framework/models/args.py); None: the family takes none.
    args_type: type | None = None

    @property
    def name(self) -> str:
        return self.names[0]

    def args_of(self, cfg: ModelConfig):
        """`model.args` as the family's dataclass; an unknown or mistyped field is refused in one
        line naming it and the fields there are (framework/models/args.py)."""
        return parse_args(self.args_type, cfg)

    def activation_checkpoint_targets(self, model: nn.Module) -> list[nn.Module]:
        return (self.checkpoint_targets or self.blocks)(model)
