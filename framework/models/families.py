"""The model families this framework builds, in one explicit list, and what the torch-free parts
of the framework (the config checks of `main.py` and the launcher, the planner) ask of them.

A family is a folder of framework/models/ whose `spec.py` (no torch) names
    NAMES                                           the `model.name` values it builds
    problems(cfg, tp, seq_len, data_vocab, ep, cp)  optional: refusals of its arguments for this
                                                    job, one line each (heads divisible by tp, ...)
    plan_shape(cfg, vocab_size) -> ModelShape       optional: the planner's shapes (shapes.py)
    check(cfg)                                      optional: the family's own refusals of the
                                                    model section (`model.args`), without torch
    record() -> ModelFamily                         its record (record.py; imports torch)
Adding a family is that folder, its `conf/model/<name>.yaml` and its line in `FAMILIES` below
(with its import). A family kept outside framework/ (a user's own) is the module named by
`model.family_module`, which calls `register_family` (registry.py) and may define `NAMES` and
`plan_shape` for the planner.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import List

from framework.errors import UserInputError
from framework.models.cnn import spec as cnn
from framework.models.hf import spec as hf
from framework.models.llama import spec as llama

# Every family of framework/models/, one line each.
FAMILIES = (llama, hf, cnn)


def spec_of(name: str) -> ModuleType | None:
    """The spec of the family of framework/models/ that builds `model.name=name`, or None."""
    return next((spec for spec in FAMILIES if name in spec.NAMES), None)


def family_names() -> List[str]:
    """Every `model.name` the families of framework/models/ build."""
    return sorted(name for spec in FAMILIES for name in spec.NAMES)


def unknown_name(name: str, names: List[str]) -> str:
    """The refusal of a `model.name` no family builds, naming the ones that are."""
    return (
        f"model.name={name!r} is not a model this framework builds; choose one of {', '.join(names)} "
        "(a Hugging Face model: model=hf model.path=<its directory>)"
    )


def import_family_module(name: str) -> ModuleType:
    """The module `model.family_module` names (importing it registers its family); one that is
    not on the path is refused in one line."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise UserInputError(
                f"model.family_module={name}: no such module on the path; give an importable "
                "module that calls register_family (e.g. my_models.family, with PYTHONPATH set)"
            ) from None
        raise


def model_problems(cfg, tp: int, seq_len: int, data_vocab: int, ep: int = 1, cp: int = 1, pp: int = 1) -> List[str]:
    """Every refusal of `cfg.model`'s arguments for this job (one line each), from its family's
    spec; for a family without `problems` (it checks when it builds), only what no such family
    can do. `data_vocab`: the vocabulary size the data's tokenizer will have, 0 when only the
    start decides."""
    spec = spec_of(cfg.name)
    if spec is None or not hasattr(spec, "problems"):
        out = []
        if ep > 1:
            out.append(f"parallelism.ep={ep}: model.name={cfg.name} has no experts to split; set parallelism.ep=1")
        if cp > 1:
            out.append(f"parallelism.cp={cp}: model.name={cfg.name} cannot split its sequences; set parallelism.cp=1")
        return out
    try:
        import inspect

        # the pipeline degree to a family whose `problems` takes it (ours); others check at the build
        kw = {"pp": pp} if pp > 1 and "pp" in inspect.signature(spec.problems).parameters else {}
        return list(spec.problems(cfg, tp, seq_len, data_vocab, ep, cp, **kw))
    except UserInputError as exc:
        return [str(exc)]


def job_model_problems(cfg) -> List[str]:
    """`model_problems` for a whole job's Config (its tensor-parallel degree, sequence length and
    the vocabulary its data fixes before start); `main.py` and the launcher call it beside
    `framework.config.validate`."""
    data = cfg.data
    data_vocab = data.vocab_size if data.name == "stdlib" and not data.tokenizer else 0
    p = cfg.parallelism
    return model_problems(cfg.model, p.tp, data.seq_len, data_vocab, ep=p.ep, cp=p.cp, pp=p.pp)


def plan_shape(cfg, vocab_size: int):
    """The `ModelShape` (shapes.py) of `cfg` (a ModelConfig) from its family; refused in one line
    where the family has none or no family builds `model.name`. Loads no other family (and no
    torch, for ours)."""
    external = getattr(cfg, "family_module", "")
    if external:
        module = import_family_module(external)  # a module that is not there is refused in one line
        if cfg.name in getattr(module, "NAMES", ()):
            return module.plan_shape(cfg, vocab_size)
    spec = spec_of(cfg.name)
    if spec is None and not external:
        raise UserInputError(unknown_name(cfg.name, family_names()))
    if spec is not None and hasattr(spec, "plan_shape"):
        return spec.plan_shape(cfg, vocab_size)
    raise UserInputError(
        f"model.name={cfg.name}: stage=plan has no shapes for this family (its folder has no shapes.py, "
        "or its model.family_module defines no NAMES and plan_shape); train it without stage=plan"
    )
