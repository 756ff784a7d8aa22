"""The model section's refusals, said before any rank starts: the family's spec where it has `check`
(no torch: [Note: no torch before the config is accepted] in framework/entrypoint.py), else the
registered family's record. Apart from families.py because the record's path goes through
registry.py, which imports families.py."""

from __future__ import annotations

from typing import List

from framework.errors import UserInputError
from framework.models.families import spec_of


def check_model(cfg) -> List[str]:
    """Every refusal of the model section (an unknown name, the family's own checks), as lines:
    from the family's spec where it has `check` (no torch: [Note: no torch before the config is
    accepted] in framework/entrypoint.py), else from its record."""
    spec = spec_of(cfg.name)
    try:
        if spec is not None and hasattr(spec, "check"):
            spec.check(cfg)
            return []
        from framework.models.registry import family_of

        family = family_of(cfg)
        family.args_of(cfg)
        family.check(cfg)
    except UserInputError as exc:
        return [str(exc)]
    return []
