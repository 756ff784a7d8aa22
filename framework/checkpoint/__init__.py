"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and the Hugging Face
style safetensors export/import. See the README section "Data preparation, checkpoints, resume and export"."""

from framework.checkpoint.layout import CheckpointError, latest_checkpoint  # noqa: F401
from framework.checkpoint.manager import EXIT_REQUEUE, CheckpointManager  # noqa: F401
