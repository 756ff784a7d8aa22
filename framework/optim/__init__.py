"""Optimizers with weight-decay groups, and learning-rate schedules."""

from framework.optim.builder import build_optimizer, build_scheduler, lr_at, no_decay_names  # noqa: F401
