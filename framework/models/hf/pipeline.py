"""Hugging Face decoders cut into pipeline stages by layers (`model=hf`, parallelism.pp).

Decoders laid out as transformers' Llama family is (`model.embed_tokens`, `model.layers`,
`model.norm`, `model.rotary_emb`, `lm_head`: Llama, Mistral, Qwen2/3 and their kin) are cut like
our Llama (framework/models/llama/pipeline.py): the embedding on the first stage, the final norm
and `lm_head` on the last, a contiguous run of decoder layers on each, under the whole model's
own names, so checkpoints and exports move between pipeline degrees. Each stage computes the
positions, the rotary table and the causal masks as the whole model's forward does (transformers'
`create_causal_mask`, and its sliding-window mask per layer type: `_masks`), so a stage's layers
see what they would see in the whole model. A mixture-of-experts decoder's experts (Mixtral,
Qwen3-MoE, DeepSeek-V3, gpt-oss) are split by expert inside the stages under `parallelism.ep`.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.errors import UserInputError

_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


class HFDecoderStage(nn.Module):
    def __init__(self, model: nn.Module, start: int, end: int, first: bool, last: bool):
        super().__init__()
        base = model.model
        self.model = nn.Module()  # the whole model's `model.` prefix
        # [Note: tied embeddings in a pipeline] (framework/distributed/pipeline.py): a head tied to
        # the embedding puts both modules (one parameter) on the first and the last stage.
        tied = model.lm_head.weight is base.embed_tokens.weight and (first or last)
        if first or tied:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in range(start, end)})
        if last:
            self.model.norm = base.norm
        if last or tied:
            self.lm_head = model.lm_head
        self.model.rotary_emb = base.rotary_emb  # a buffer only (inv_freq): shared by the stages
        self.first, self.last = first, last
        self.__dict__["_config"] = model.config
        self.dim, self.vocab_size = int(model.config.hidden_size), int(model.config.vocab_size)

    # What the tensor-parallel plan (framework/models/hf/parallelize.py) reads of a transformers
    # model, answered for this stage: its config, the base model's prefix, and the embedding and
    # head where this stage holds them.
    base_model_prefix = "model"

    @property
    def config(self):
        return self._config

    def get_input_embeddings(self):
        return self.model.embed_tokens if self.first else None

    def get_output_embeddings(self):
        return self.lm_head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = _masks(self._config, h, positions)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        kinds = getattr(self._config, "layer_types", None)
        for index, layer in self.model.layers.items():
            mask = masks[kinds[int(index)]] if kinds else masks["default"]
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(self.model.norm(h)) if self.last else h

    def example_io(self, batch: int, seq: int, dtype: torch.dtype, tp: int = 1, hidden_seq: int | None = None) -> tuple:
        """As our Llama stage's. Its forward derives the positions and the causal mask from the
        length it is given, so it takes whole sequences only."""
        if hidden_seq not in (None, seq):
            raise UserInputError(
                "parallelism.sequence_parallel=true with parallelism.pp and model=hf: a Hugging Face decoder's "
                "stages take whole sequences (their positions and mask come from the length); set "
                "parallelism.sequence_parallel=false"
            )
        x = (
            torch.empty(batch, seq, dtype=torch.long, device="meta")
            if self.first
            else torch.empty(batch, seq, self.dim, dtype=dtype, device="meta")
        )
        width = self.vocab_size // tp if self.last else self.dim
        return x, torch.empty(batch, seq, width, dtype=dtype, device="meta")


def _masks(config, h: torch.Tensor, positions: torch.Tensor) -> dict:
    """The causal masks the whole model's forward builds: per layer type where the config lists
    them (`layer_types`: gpt-oss's and Qwen2/3's sliding-window layers beside full ones), else one
    ("default"), sliding-window where the config sets a window (Mistral, Mixtral), as their models do."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    def build(fn):
        return fn(config=config, inputs_embeds=h, attention_mask=None, past_key_values=None, position_ids=positions)

    kinds = getattr(config, "layer_types", None)
    if kinds:
        return {
            kind: build(create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)
            for kind in set(kinds)
        }
    window = getattr(config, "sliding_window", None) is not None
    return {"default": build(create_sliding_window_causal_mask if window else create_causal_mask)}


def check_pipeline(model: nn.Module, pp: int) -> None:
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, p) for p in _PARTS) or not hasattr(model, "lm_head"):
        raise UserInputError(
            f"parallelism.pp={pp} with model=hf ({type(model).__name__}): stages are cut from decoders laid out "
            "as transformers' Llama (model.embed_tokens, model.layers, model.norm, lm_head) only; set "
            "parallelism.pp=1"
        )


def pipeline_stage(model: nn.Module, start: int, end: int, first: bool, last: bool) -> HFDecoderStage:
    return HFDecoderStage(model, start, end, first, last)
