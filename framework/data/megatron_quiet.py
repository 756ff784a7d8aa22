"""Importing megatron.core warns that Transformer Engine and Apex are missing (GPU training
packages our data path never uses), and its dataset builders log every index file at INFO.
Import it once here with those warnings silenced and its loggers at WARNING."""

import logging
import warnings

for name in ("megatron", "megatron_fsdp", "megatron.core"):
    logging.getLogger(name).setLevel(logging.WARNING)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    import megatron.core  # noqa: F401
