"""The small image classifier of the digits recipe (`experiment=digits_cnn`).

Importing this package loads nothing heavy: its record is in `family.py` (torch); it has no
`shapes.py`, so stage=plan refuses it. The names below come from their modules on first use."""

_WHERE = {"FAMILY": "family", "DigitsCNN": "model", "build_cnn": "family"}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
