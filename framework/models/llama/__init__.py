"""Our Llama family: the model, its tensor-parallel plan, its Hugging Face adapter.

Importing this package loads nothing heavy: its record is in `family.py` (torch), what the
planner needs in `shapes.py` (no torch). The names below come from their modules on first use."""

_WHERE = {
    "FAMILY": "family",
    "PRESETS": "family",
    "Transformer": "model",
    "TransformerBlock": "model",
    "build_llama": "model",
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
