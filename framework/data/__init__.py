"""Datasets, tokenizers and resumable samplers.

The builders (and torch with them) are imported on first use: the checks run before any rank
starts read tokenizers from here without torch ([Note: no torch before the config is accepted]
in framework/entrypoint.py)."""

_LAZY = {
    "build_data": "framework.data.build",
    "DataBundle": "framework.data.loader",
    "GlobalBatchLoader": "framework.data.loader",
    "SampleSource": "framework.data.loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
