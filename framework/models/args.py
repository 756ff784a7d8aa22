"""A family's own typed arguments (`model.args`), read without torch.

Every family declares the dataclass of its arguments (`ModelFamily.args_type`, e.g. our Llama's
`LlamaArgs` with its sizes, the CNN's `DigitsCNNArgs`); the central `ModelConfig` keeps only what
every model has (name, path, task, init). `parse_args` fills the dataclass from `model.args`,
refusing an unknown or mistyped field in one line.

A family may also keep a torch-free `args.py` in its folder, with `NAMES` (the `model.name` values
it builds) and `problems(cfg, tp, seq_len, data_vocab, ep, cp) -> list[str]`: the checks of its
arguments against the rest of the job (heads divisible by the tensor-parallel degree, a sequence
longer than the model takes). `model_problems` asks it; `main.py` and the launcher run it with
the config's own checks, before any rank starts and without importing torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, List

from framework.errors import UserInputError


def parse_args(args_type: type | None, cfg) -> Any:
    """`cfg.args` (a ModelConfig's) as `args_type`; None where the family takes none."""
    given = dict(cfg.args or {})
    if args_type is None:
        if given:
            raise UserInputError(f"model.args: model.name={cfg.name} takes no family arguments; drop model.args")
        return None
    fields = {f.name: f for f in dataclasses.fields(args_type)}
    for key, value in given.items():
        if key not in fields:
            raise UserInputError(
                f"model.args.{key}: model.name={cfg.name} has no such argument; its arguments are {', '.join(fields)}"
            )
        default = fields[key].default
        if default is dataclasses.MISSING or default is None:  # no default type to hold it to
            continue
        kinds = (int, float) if isinstance(default, float) else type(default)  # 0 is a fine float
        if not isinstance(value, kinds) or isinstance(value, bool) != isinstance(default, bool):
            kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
                type(default), f"a {type(default).__name__}"
            )
            raise UserInputError(f"model.args.{key}={value!r}: give {kind}")
    return args_type(**given)


def _args_module(name: str):
    """The torch-free `args.py` of the family folder whose NAMES hold `name`, or None."""
    from framework.models.shapes import family_packages

    for package in family_packages():
        try:
            module = importlib.import_module(f"framework.models.{package}.args")
        except ModuleNotFoundError as exc:
            if exc.name != f"framework.models.{package}.args":
                raise
            continue
        if name in getattr(module, "NAMES", ()):
            return module
    return None


def model_problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1) -> List[str]:
    """Every refusal of `cfg.model`'s arguments for this job (one line each), from its family's
    torch-free `args.py`; empty for a family without one (it checks when it builds).
    `data_vocab`: the vocabulary size the data's tokenizer will have, 0 when only the start decides."""
    module = _args_module(cfg.name)
    if module is None:
        out = []
        if ep > 1:
            out.append(f"parallelism.ep={ep}: model.name={cfg.name} has no experts to split; set parallelism.ep=1")
        if cp > 1:
            out.append(f"parallelism.cp={cp}: model.name={cfg.name} cannot split its sequences; set parallelism.cp=1")
        return out
    try:
        return list(module.problems(cfg, tp, seq_len, data_vocab, ep, cp))
    except UserInputError as exc:
        return [str(exc)]


def job_model_problems(cfg) -> List[str]:
    """`model_problems` for a whole job's Config (its tensor-parallel degree, sequence length and
    the vocabulary its data fixes before start); `main.py` and the launcher call it beside
    `framework.config.validate`."""
    data = cfg.data
    data_vocab = data.vocab_size if data.name == "stdlib" and not data.tokenizer else 0
    p = cfg.parallelism
    return model_problems(cfg.model, p.tp, data.seq_len, data_vocab, ep=p.ep, cp=p.cp)
