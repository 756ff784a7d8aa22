"""Hugging Face `transformers` models through our engine (`model=hf`, docs/models.md).

The model comes from a local directory (`model.path`, holding `config.json` and optionally
safetensors weights) or from an inline config (`model.config`, for tests); nothing is ever
downloaded and no code from a directory is run (`auto_map` / custom code is refused). The sharding
units are the model's own `_no_split_modules` (decoder/encoder blocks); the root keeps the rest
(embeddings, tied heads, final norms). Weights are read by `framework/checkpoint/hf.py`, each rank
only its own slices (see [Note: sliced import]).
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import lru_cache

import torch
from torch import nn

from framework.config.schema import ModelConfig
from framework.errors import UserInputError

TASK_CLASSES = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "sequence_classification": "AutoModelForSequenceClassification",
}


def _config_dict(cfg: ModelConfig) -> dict:
    """config.json of model.path, or the inline model.config; refusals name the field."""
    if cfg.path and cfg.config:
        raise UserInputError("model=hf: set model.path or model.config, not both")
    if cfg.config:
        data = _plain(cfg.config)
        if "model_type" not in data:
            raise UserInputError("model.config needs model_type (e.g. model.config={model_type: gpt2, n_layer: 2})")
        return data
    if not cfg.path:
        raise UserInputError(
            "model=hf needs model.path=<a local directory with config.json> "
            "(or an inline model.config={model_type: ...})"
        )
    if os.path.isfile(cfg.path):
        raise UserInputError(f"model.path={cfg.path}: this is a file; give the directory that holds config.json")
    if not os.path.isdir(cfg.path):
        raise UserInputError(
            f"model.path={cfg.path}: no such local directory, and nothing is downloaded; "
            f"download it first (e.g. `hf download {cfg.path} --local-dir <dir>`) and "
            "set model.path=<dir>"
        )
    path = os.path.join(cfg.path, "config.json")
    if not os.path.isfile(path):
        raise UserInputError(
            f"model.path={cfg.path}: no config.json in this directory; give the directory "
            "written by transformers' save_pretrained"
        )
    from framework.fileio import read_json

    data = read_json(path)
    if not isinstance(data, dict):
        raise UserInputError(f"{path} is not a JSON object; give the config.json save_pretrained wrote")
    if data.get("auto_map"):
        raise UserInputError(
            f"model.path={cfg.path}: config.json asks for custom model code (auto_map), "
            "which this framework never runs; use a model type built into transformers"
        )
    return data


def _plain(value):
    """OmegaConf containers and tuples as plain JSON-like values (the config is hashed and saved)."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@lru_cache(maxsize=8)
def _hf_config(config_json: str, task: str, num_labels: int):
    from transformers import AutoConfig

    data = json.loads(config_json)
    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise UserInputError(f"model=hf: model_type={model_type!r} is not built into transformers ({exc})") from None
    if task == "sequence_classification":
        if num_labels > 0:  # else the directory's own (its id2label), 2 when it says nothing
            config.num_labels = num_labels
        if getattr(config, "pad_token_id", None) is None:
            # Batches of more than one sequence need it to find each row's last token.
            eos = getattr(config, "eos_token_id", None)
            config.pad_token_id = eos if isinstance(eos, int) and eos < config.vocab_size else 0
    if task == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return config


# The head a saved model was trained with, by the ending of its class name in config.json's
# `architectures` (what save_pretrained writes); an encoder-decoder's ...ForConditionalGeneration
# is seq2seq, a decoder's (some vision-language models) causal_lm.
_ARCHITECTURE_TASKS = (
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForConditionalGeneration", None),
)


def task_of(cfg: ModelConfig) -> str:
    """model.task, or the task config.json's `architectures` names (causal_lm when it names none,
    as an inline model.config does); refused in one line, naming the override, when the
    architecture's head is no task we train."""
    if cfg.task:
        if cfg.task not in TASK_CLASSES:
            raise UserInputError(f"model.task={cfg.task!r}: choose one of {', '.join(TASK_CLASSES)}")
        return cfg.task
    data = _config_dict(cfg)
    architectures = data.get("architectures") or []
    if not architectures:
        return "causal_lm"
    for suffix, task in _ARCHITECTURE_TASKS:
        if architectures[0].endswith(suffix):
            return task or ("seq2seq" if data.get("is_encoder_decoder", True) else "causal_lm")
    where = f"model.path={cfg.path}" if cfg.path else "model.config"
    raise UserInputError(
        f"{where}: config.json's architectures {architectures} name no task this framework trains; "
        f"set model.task to one of {', '.join(TASK_CLASSES)} (e.g. model.task=sequence_classification)"
    )


_PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_WEIGHT_NAMES = ("pytorch_model", "model", "consolidated", "adapter_model")


def check_config(cfg: ModelConfig) -> None:
    """The refusals that need no transformers import: the task, model.path or model.config, and
    weights only in pickled files (never unpickled: without this the model would silently start
    from its random initialisation)."""
    task_of(cfg)
    if cfg.path and os.path.isdir(cfg.path) and not weights_dir(cfg):
        # weight files by their usual names (a Trainer's training_args.bin or optimizer.pt is not weights)
        pickled = sorted(
            n for n in os.listdir(cfg.path) if n.endswith(_PICKLED_WEIGHTS) and n.startswith(_WEIGHT_NAMES)
        )
        if pickled:
            raise UserInputError(
                f"model.path={cfg.path}: its weights are only in {pickled[0]} (a pickle, which this framework "
                "never loads: it can run code); convert them once to safetensors, e.g. in Python: "
                "AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
            )


def hf_config(cfg: ModelConfig):
    """The transformers config of `cfg` (cached: every build and the data ask for it)."""
    return _hf_config(json.dumps(_config_dict(cfg), sort_keys=True), task_of(cfg), cfg.num_labels)


def num_labels(cfg: ModelConfig) -> int:
    return int(hf_config(cfg).num_labels)


def build_hf(cfg: ModelConfig, device="cpu") -> nn.Module:
    import transformers

    task = task_of(cfg)
    auto = getattr(transformers, TASK_CLASSES[task])
    # A config of its own: transformers keeps the one it is given, which `hf_config` caches, and a
    # setting made on one model (its attention implementation) must reach no other.
    config = copy.deepcopy(hf_config(cfg))
    # Training keeps no key/value cache: a cache filled in forward would differ when activation
    # checkpointing recomputes the block (the export says use_cache=true again for generation).
    # Set before the build: some models copy the config into their parts (T5's decoder stack).
    config.use_cache = False
    try:
        with torch.device(device):
            model = auto.from_config(config, dtype=torch.float32)
    except ValueError as exc:
        raise UserInputError(
            f"model.task={task}: transformers has no such model for "
            f"model_type={config.model_type} ({str(exc).splitlines()[0]})"
        ) from None
    from framework.models.hf.moe import count_routers, make_splittable

    make_splittable(model)  # splittable by expert (parallelism.ep); computes the same until split
    count_routers(model)  # the routers' loads in the step's record (framework/routing.py)
    return model


def blocks(model: nn.Module) -> list:
    """The modules named by `_no_split_modules` (outermost ones, in registration order)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found, inside = [], set()
    for name, module in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if any(c.__name__ in names for c in type(module).__mro__):  # also once wrapped by fully_shard
            found.append(module)
            inside.add(name)
    if not found:
        raise UserInputError(
            f"model=hf: {type(model).__name__} names no blocks (_no_split_modules); "
            "this model type cannot be sharded per block"
        )
    return found


@torch.no_grad()
def init_weights(model: nn.Module, seed) -> None:
    """Built on the CPU, the model was initialised by transformers at construction from the seeded
    RNG (the same on every rank). After `to_empty` from meta (seed None) every parameter and buffer
    is initialised again by the model's own `_init_weights`."""
    if seed is not None:
        return
    for module in model.modules():
        module._is_hf_initialized = False
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
    model.initialize_weights()


def weights_dir(cfg: ModelConfig) -> str:
    """model.path when it holds weights (else the model starts from its initialisation)."""
    if not cfg.path:
        return ""
    has = any(os.path.isfile(os.path.join(cfg.path, n)) for n in ("model.safetensors", "model.safetensors.index.json"))
    return cfg.path if has else ""


def _targets(transform) -> list:
    targets = transform.target_patterns
    targets = [targets] if isinstance(targets, str) else list(targets)
    return targets * len(transform.source_patterns) if len(targets) == 1 else targets


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6 x non-embedding parameters: the dense-matmul estimate."""
    emb = model.get_input_embeddings()
    params = {id(p): p for p in model.parameters()}
    return 6.0 * sum(p.numel() for i, p in params.items() if emb is None or i != id(emb.weight))


class HFAdapter:
    """Names are the model's own (identity); a tied copy is not written and is read from its
    source; tensors transformers itself ignores on load are ignored too."""

    def __init__(self, cfg: ModelConfig):
        with torch.device("meta"):
            model = build_hf(cfg, "meta")
        self.tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # target -> source
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        self.ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
        self.config = model.config
        self.architecture = type(model).__name__
        try:  # how transformers renames and fuses what save_pretrained wrote (transformers >= 5)
            from transformers.conversion_mapping import get_model_conversion_mapping

            self.transforms = list(get_model_conversion_mapping(model))
        except (ImportError, AttributeError, TypeError):
            self.transforms = []

    # [Note: what save_pretrained writes]
    # transformers 5 keeps some models' weights in other names and shapes than their files: GPT-NeoX's
    # `embed_out` is the model's `lm_head`, Mixtral's `block_sparse_moe.experts.3.w1.weight` (one
    # tensor per expert) are stacked into `mlp.experts.gate_up_proj`; save_pretrained writes the
    # file names. `converted_names` reads the model's own conversion list (its renamings and its
    # merges: stack per expert, concatenate gate and up) and says, for each model name the files
    # lack, which file tensors make it; the import stacks and joins them, and refuses any other
    # operation in one line. Exports keep the model's names, which transformers loads as they are.

    def converted_names(self, keys, where: str):
        """({model name: file name} for renamed tensors, {model name: (operations, [[file names] per
        source pattern, in expert order])} for merged ones), from the file's tensor names."""
        renamings = [t for t in self.transforms if type(t).__name__ == "WeightRenaming"]
        converters = [t for t in self.transforms if type(t).__name__ == "WeightConverter"]
        renamed, merged = {}, {}
        for key in keys:
            name = key
            for t in renamings:
                for source, target in zip(t.source_patterns, _targets(t)):
                    try:
                        name = re.sub(source, target, name)
                    except re.error:
                        continue
            hit = False
            for t in converters:
                target = _targets(t)[0]
                for slot, source in enumerate(t.source_patterns):
                    match = re.search(re.escape(source).replace(r"\*", r"(\d+)"), name)
                    if match is None:
                        continue
                    fused = name[: match.start()] + target + name[match.end() :]
                    index = int(match.group(1)) if match.groups() else 0
                    entry = merged.setdefault(fused, (t.operations, {}))
                    entry[1].setdefault(slot, {})[index] = key
                    hit = True
                    break
                if hit:
                    break
            if not hit and name != key:
                renamed[name] = key
        out = {}
        for fused, (operations, slots) in merged.items():
            groups = []
            for slot in sorted(slots):
                experts = slots[slot]
                if sorted(experts) != list(range(len(experts))):
                    raise UserInputError(f"{where}: the tensors merged into {fused} skip an expert index")
                groups.append([experts[i] for i in range(len(experts))])
            out[fused] = (operations, groups)
        return renamed, out

    def to_hf(self, name: str):
        return None if name in self.tied else name

    def from_hf_fallback(self, name: str):
        if name in self.tied:
            return self.tied[name]
        if self.prefix and name.startswith(self.prefix + "."):
            return name[len(self.prefix) + 1 :]  # a base-model checkpoint into a model with a head
        return None

    def ignorable(self, key: str) -> bool:
        return any(p.search(key) for p in self.ignore)

    def hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict:
        data = json.loads(self.config.to_json_string(use_diff=False))
        data["architectures"] = [self.architecture]
        data["use_cache"] = True
        data["dtype"] = str(dtype).replace("torch.", "")
        return data

    def write_extras(self, out_dir: str, tokenizer, cfg: ModelConfig) -> None:
        """The tokenizer and generation files of model.path, copied unchanged (never through a link
        planted in `out_dir`)."""
        from framework.fileio import copy_file

        if not cfg.path:
            return
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.json",
            "merges.txt",
            "spiece.model",
            "tokenizer.model",
            "generation_config.json",
        ):
            if os.path.isfile(os.path.join(cfg.path, name)):
                copy_file(os.path.join(cfg.path, name), os.path.join(out_dir, name))

    def check_hf_config(self, hf: dict, cfg: ModelConfig, where: str) -> None:
        mine = json.loads(self.config.to_json_string(use_diff=False))
        if hf.get("model_type") != mine.get("model_type"):
            raise UserInputError(
                f"{where}: its config.json has model_type={hf.get('model_type')!r}, the model "
                f"is {mine.get('model_type')!r}"
            )
