"""The model registry: one record per model family, everything the rest of the framework needs to
know about a model, looked up by `model.name`.

Nothing outside `framework/models/` knows a model's attribute names or tensor names: the trainer,
`framework/distributed/parallelize.py` and the checkpoint code ask the family record instead.

    from framework.models import family_of
    family = family_of(cfg.model)            # refuses an unknown model.name in one line
    model = family.build(cfg.model, "cpu")   # plain nn.Module, no parallel code
    family.init_weights(model, seed)         # in place, also after `to_empty` from meta (seed=None)
    family.blocks(model)                     # the sharding units, in forward order
    task = family.task(cfg.model)            # how a batch becomes a loss: task.loss(model, batch)

The families of framework/models/ are listed in `framework/models/families.py` (one line each);
each builds its record (`ModelFamily`, framework/models/record.py) in its folder's `family.py`, as
our Llama does in `framework/models/llama/family.py`. A family kept outside this package (a
user's own, or a test's) is a module named by `model.family_module` in its conf/model YAML,
imported before the name is looked up, that registers its record:

    from framework.models.registry import ModelFamily, register_family

    register_family(ModelFamily(
        names=("my_mlp",),                     # the model.name values this family accepts
        build=build_mlp,                       # (ModelConfig, device) -> nn.Module
        blocks=lambda m: list(m.blocks),       # sharding units; the root takes the rest
        task=lambda cfg: get_task("causal_lm"),
    ))

Every other field has a default that suits a small model without tensor parallelism or a
Hugging Face export: see `ModelFamily`. A task is looked up by name from `framework/models/tasks.py`
(`causal_lm`, `seq2seq`, `sequence_classification`, `image_classification`); `register_task` adds one.
"""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.errors import UserInputError
from framework.models.families import family_names, import_family_module, spec_of, unknown_name  # noqa: F401
from framework.models.record import ModelFamily, StateDictAdapter  # noqa: F401 - what a family outside registers

# Families registered by the modules `model.family_module` names (the ones of framework/models/
# are in framework/models/families.py).
_OUTSIDE: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family from outside framework/models/ under each of its names; a name may belong to
    one family only."""
    for name in family.names:
        spec = spec_of(name)
        if (spec is not None and spec.record() is not family) or _OUTSIDE.get(name, family) is not family:
            raise RuntimeError(f"model name {name!r} is registered twice")
        _OUTSIDE[name] = family
    return family


def registered_names() -> list[str]:
    return sorted({*family_names(), *_OUTSIDE})


def build_model(cfg: ModelConfig, device="cpu") -> nn.Module:
    """The plain model `model.name` names, on `device` (meta: no memory)."""
    return family_of(cfg).build(cfg, device)


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family that builds `model.name`; an unknown name is refused in one line."""
    spec = spec_of(cfg.name)
    if spec is not None:
        return spec.record()
    if cfg.name not in _OUTSIDE and cfg.family_module:
        import_family_module(cfg.family_module)  # registers its family
    if cfg.name not in _OUTSIDE:
        raise UserInputError(unknown_name(cfg.name, registered_names()))
    return _OUTSIDE[cfg.name]
