"""Model definitions (plain nn.Modules) and the registry that describes each family to the rest of
the framework (`framework/models/registry.py`).

A family is a folder here with a torch-free `spec.py` and a `family.py` that builds its record,
plus its `conf/model/<name>.yaml` and its line in `framework/models/families.py` (the list the
registry looks names up in). Importing this package loads no family and no torch: the names
below are looked up on first use.
"""

_WHERE = {
    "ModelFamily": "registry",
    "family_of": "registry",
    "register_family": "registry",
    "build_model": "registry",
    "Task": "tasks",
    "get_task": "tasks",
    "register_task": "tasks",
}


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
