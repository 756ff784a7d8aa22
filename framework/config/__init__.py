"""Typed configuration, its Hydra registration and validation. The only Hydra user in framework/."""

from framework.config.compose import compose_config, to_config  # noqa: F401
from framework.config.schema import (  # noqa: F401
    ActivationCheckpointing,
    CheckpointConfig,
    ClusterConfig,
    Config,
    DataConfig,
    DataName,
    Engine,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    OptimizerName,
    ParallelismConfig,
    Schedule,
    Stage,
    Strategy,
    TrainerConfig,
)
from framework.config.store import register as register_schema  # noqa: F401
from framework.config.validate import parallel_dims_of, validate, world_size_of  # noqa: F401
