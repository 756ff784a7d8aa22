"""Handing the host heap's free pages back to the OS once per backward (CPU compute only).

See [Note: free host pages go back before the last unit's backward]."""

from __future__ import annotations

import ctypes
from typing import Callable, List, Optional

# [Note: free host pages go back before the last unit's backward]
# On the host, tensors come from the C library's heap, and glibc keeps the pages of freed heap
# chunks resident: `free` returns memory to the OS only from the top of the heap. By the end of a
# backward every block's activations have been freed into holes between longer-lived tensors
# (gradient shards, optimizer state), and the last unit's backward then allocates the largest
# tensors of the step: in a language model that unit holds the embedding, whose full gradient
# (vocab x dim, summed over its uses when the head is tied to it) does not fit the holes. So the
# step's peak RSS is the resident holes plus those gradients. Once per backward, right after the
# reduction of every unit but the last has been issued, the engine calls glibc's
# `malloc_trim(0)`, which releases the whole free pages inside the heap (their contents are not
# needed; what is in use is untouched).
# Measured on `bench/engine.py` (25M, 2 ranks, medians of 3 runs): peak RSS per rank 845 MB
# without, 770 with (FSDP2: 1079). It is not free: one trim takes 2-7 ms, and the released holes
# fault back in when the optimizer step and the next forward reuse them, which cost 2-9% of the
# step time there (bench/RESULTS.md). Only units that compute on the CPU trim, only with a C
# library that has `malloc_trim` (glibc); `set_host_memory_trim(False)` or
# `parallelism.host_memory_trim=false` turns it off. Accelerator memory has its own caching
# allocator and is not affected. A backward whose reductions are left to the final callback (a
# unit that waits for an earlier one in the fixed order, see context.py) does not trim: by then
# the last unit's gradients have been allocated and there is nothing left to lower.

_enabled = [True]
_trim_fn: List[Optional[Callable[[int], int]]] = []  # resolved on first use: [fn] or [None]


def set_host_memory_trim(enabled: bool) -> None:
    """Whether CPU training returns the heap's free pages to the OS once per backward (see the
    note above). Applies from the next backward on."""
    _enabled[0] = bool(enabled)


def host_memory_trim_enabled() -> bool:
    return _enabled[0]


def _malloc_trim() -> Optional[Callable[[int], int]]:
    if not _trim_fn:
        try:
            fn = ctypes.CDLL(None).malloc_trim
            fn.argtypes = [ctypes.c_size_t]
            fn.restype = ctypes.c_int
        except (AttributeError, OSError):  # not glibc (musl, macOS): nothing to call
            fn = None
        _trim_fn.append(fn)
    return _trim_fn[0]


def trim_host_heap() -> bool:
    """Release the free pages of the C heap to the OS now; False where that is unavailable or off."""
    fn = _malloc_trim() if _enabled[0] else None
    if fn is None:
        return False
    fn(0)
    return True
