"""Composing the config outside `main.py` (tests, the launcher) and turning it into objects."""

from __future__ import annotations

import os
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import Config
from framework.config.store import register

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as typed objects; each section's `__post_init__` runs here. A key
    the schema does not have (`+optimizer.lrr=1`, which Hydra accepts) is refused, naming the
    nearest real one."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    check_known_keys(cfg, Config)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def check_known_keys(node, schema, prefix: str = "") -> None:
    """Raise UserInputError for the first key of `node` (a DictConfig) that the dataclass `schema`
    has no field for; mappings typed Dict/Any in the schema (free-form: env, labels, a model's own
    args) are not looked into."""
    import dataclasses
    import difflib
    import typing

    from framework.errors import UserInputError

    if not dataclasses.is_dataclass(schema) or not isinstance(node, DictConfig):
        return
    hints = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]
    for key in node.keys():
        if key not in hints:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; the settings there are: {', '.join(names)}"
            raise UserInputError(f"{prefix}{key}: no such setting (a '+' adds keys the job would ignore){hint}")
        hint = hints[key]
        for candidate in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(candidate):
                check_known_keys(node._get_node(key), candidate, f"{prefix}{key}.")
                break


def compose_config(overrides: Optional[List[str]] = None, config_name: str = "config") -> DictConfig:
    """Compose `conf/config.yaml` with overrides, exactly as `main.py` would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides or []))
