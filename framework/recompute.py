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


@contextlib.contextmanager
def _recompute_region():
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def recompute_contexts():
    """`context_fn` for torch.utils.checkpoint: nothing around the first forward, the mark around
    the recompute."""
    return contextlib.nullcontext(), _recompute_region()
