"""Building a model on the meta device without its random initialisation.

[Note: random fills on the meta device]
A meta tensor has no values, so a random fill (`normal_`, `uniform_`, ...) on it only checks its
arguments; yet torch 2.13's meta `normal_` costs ~2 s the first time in a process (it goes through
torch's Python reference kernels), and every job builds its model on meta once, to count its
parameters, and large models to shard them before materialising. Under `device("meta")` the
builds here skip those fills: the same shapes, dtypes and parameters, and the real values are
drawn when the model is materialised (`init_weights`), as before.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_FILLS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.random_,
    torch.Tensor.exponential_,
    torch.Tensor.geometric_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.bernoulli_,
}


def _is_fill(func) -> bool:
    # torch.nn.init's functions (normal_, trunc_normal_, kaiming_uniform_, ...) are torch functions
    # themselves: the fill inside them would run below this mode, so they are caught whole
    return func in _FILLS or getattr(func, "__module__", "") == "torch.nn.init"


class _SkipFillsOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta and _is_fill(func):
            return args[0]
        return func(*args, **(kwargs or {}))


def on_device(device) -> contextlib.AbstractContextManager:
    """`torch.device(device)`, and on meta without random fills (see the note above)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    if torch.device(device).type == "meta":
        stack.enter_context(_SkipFillsOnMeta())
    return stack
