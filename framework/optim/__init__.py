"""Optimizers with weight-decay groups, and learning-rate schedules."""

from framework.optim.builder import (  # noqa: F401
    build_optimizer,
    build_scheduler,
    hidden_matrix_names,
    lr_at,
    no_decay_names,
)
