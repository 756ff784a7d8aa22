"""Composing the config outside `main.py` (tests, the launcher) and turning it into objects."""

from __future__ import annotations

import os
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import Config
from framework.config.store import register

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def to_config(cfg: DictConfig) -> Config:
    """The composed DictConfig as typed objects; each section's `__post_init__` runs here."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def compose_config(overrides: Optional[List[str]] = None, config_name: str = "config") -> DictConfig:
    """Compose `conf/config.yaml` with overrides, exactly as `main.py` would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides or []))
