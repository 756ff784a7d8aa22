"""Whether the code running now is activation checkpointing's recompute of a block's forward.

The engine marks the recompute (framework/distributed/parallelize.py passes `recompute_contexts`
to torch's non-reentrant checkpoint); a model asks `recomputing()` where a forward has a side
effect that must happen once per real forward, such as a router counting its tokens
(framework/models/llama/moe.py). Neither side imports the other: both import this module."""

from __future__ import annotations

import contextlib
import contextvars

_RECOMPUTING = contextvars.ContextVar("recomputing", default=False)


def recomputing() -> bool:
    return _RECOMPUTING.get()


class _RecomputeRegion:
    """The mark around a recompute. Re-enterable: a block may be recomputed more than once from
    one forward (zbv's input and weight halves each recompute a checkpointed block), and torch
    enters the same context object each time."""

    def __init__(self) -> None:
        self._tokens: list = []

    def __enter__(self) -> None:
        self._tokens.append(_RECOMPUTING.set(True))

    def __exit__(self, *exc) -> None:
        _RECOMPUTING.reset(self._tokens.pop())


def recompute_contexts():
    """`context_fn` for torch.utils.checkpoint: nothing around the first forward, the mark around
    each recompute."""
    return contextlib.nullcontext(), _RecomputeRegion()
