"""A family's own typed arguments (`model.args`), read without torch.

Every family declares the dataclass of its arguments (`ModelFamily.args_type`, e.g. our Llama's
`LlamaArgs` with its sizes, the CNN's `DigitsCNNArgs`); the central `ModelConfig` keeps only what
every model has (name, path, task, init). `parse_args` fills the dataclass from `model.args`,
refusing an unknown or mistyped field in one line. The checks of a family's arguments against
the rest of the job are its spec's `problems` (`framework/models/families.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from framework.errors import UserInputError


def parse_args(args_type: type | None, cfg) -> Any:
    """`cfg.args` (a ModelConfig's) as `args_type`; None where the family takes none."""
    given = dict(cfg.args or {})
    if args_type is None:
        if given:
            raise UserInputError(f"model.args: model.name={cfg.name} takes no family arguments; drop model.args")
        return None
    fields = {f.name: f for f in dataclasses.fields(args_type)}
    for key, value in given.items():
        if key not in fields:
            raise UserInputError(
                f"model.args.{key}: model.name={cfg.name} has no such argument; its arguments are {', '.join(fields)}"
            )
        default = fields[key].default
        if default is dataclasses.MISSING or default is None:  # no default type to hold it to
            continue
        kinds = (int, float) if isinstance(default, float) else type(default)  # 0 is a fine float
        if not isinstance(value, kinds) or isinstance(value, bool) != isinstance(default, bool):
            kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
                type(default), f"a {type(default).__name__}"
            )
            raise UserInputError(f"model.args.{key}={value!r}: give {kind}")
    return args_type(**given)
