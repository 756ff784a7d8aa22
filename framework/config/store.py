"""Registers the typed schema with Hydra's ConfigStore, so YAML is checked against it."""

from hydra.core.config_store import ConfigStore

from framework.config.schema import Config


def register() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)
