"""A job reads no model or dataset hub: Hugging Face's libraries are put offline, whatever the
environment said.

[Note: offline whatever the environment says]
huggingface_hub reads HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) once, when it is imported, into
`huggingface_hub.constants.HF_HUB_OFFLINE`, and `datasets` copies it into its own
`datasets.config.HF_HUB_OFFLINE` when it is imported; transformers asks huggingface_hub. So setting
the variable only when it is unset (`os.environ.setdefault`) left a job online twice over: an
inherited `HF_HUB_OFFLINE=0` won, and in a process that had imported transformers before the
variable was set the libraries had already read "online". `hub_offline` sets the variables to "1"
(for this process and every rank it starts, forked or spawned) and the flags of the libraries
already imported, so every request to a hub fails in the library (OfflineModeIsEnabled) before a
connection is made. Names that only a hub knows are refused before any rank starts (data.paths,
model.path; framework/config/validate.py, framework/models/hf/model.py); what only the ranks find
(an lm-eval task whose data is on a hub) ends there, in one line, without a connection.
"""

from __future__ import annotations

import os
import sys

_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> None:
    """Put huggingface_hub, datasets and transformers offline in this process and its children."""
    for name in _VARIABLES:
        os.environ[name] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    config = sys.modules.get("datasets.config")
    if config is not None:
        config.HF_HUB_OFFLINE = True
        config.HF_DATASETS_OFFLINE = True
