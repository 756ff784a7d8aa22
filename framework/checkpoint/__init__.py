"""Sharded, atomic, resumable checkpoints (torch.distributed.checkpoint) and the Hugging Face
style safetensors export/import. See the README section "Data preparation, checkpoints, resume and export".

The manager (and torch with it) is imported on first use: the entry point takes the run
directory's lock (run_lock.py) before a config is accepted, without torch ([Note: no torch before
the config is accepted] in framework/entrypoint.py)."""

from framework.checkpoint.layout import CheckpointError, latest_checkpoint  # noqa: F401

_LAZY = ("EXIT_REQUEUE", "CheckpointManager")


def __getattr__(name: str):
    if name in _LAZY:
        from framework.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
