"""Run code written for torch's `fully_shard` on our engine: imported by every Python process the
runner starts (this folder is put first on PYTHONPATH), spawned ranks included.

With UPSTREAM_FSDP2_ENGINE=ours, the names FSDP2's tests import from `torch.distributed.fsdp`
(and its older spelling `torch.distributed._composable.fsdp`) are rebound to ours, before any
test module (or torch's own test helpers) imports them; with =torch nothing changes, so one
command measures torch's engine on the same files. torch's private FSDP2 modules
(`_fully_shard._fsdp_collectives`, `_fsdp_param_group`, ...) stay torch's: tests that patch them
observe nothing of ours, which the runner's table shows as what it is.
"""

import importlib
import os
import sys

if os.environ.get("UPSTREAM_FSDP2_ENGINE") == "ours":
    import torch.distributed.fsdp as _torch_fsdp

    import framework.distributed.fsdp as _ours

    _NAMES = (
        "fully_shard",
        "FSDPModule",
        "UnshardHandle",
        "MixedPrecisionPolicy",
        "CPUOffloadPolicy",
        "OffloadPolicy",
        "register_fsdp_forward_method",
    )
    _targets = [_torch_fsdp]
    for _path in ("torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard"):
        try:  # a module, not the function of the same name its package exports
            _targets.append(importlib.import_module(_path) and sys.modules[_path])
        except ImportError:  # a torch without the older spelling
            pass
    for _mod in _targets:
        for _name in _NAMES:
            if hasattr(_ours, _name):
                setattr(_mod, _name, getattr(_ours, _name))

# CPU ranks for torch's multi-process test base: with no accelerator, torch 2.13's `FSDPTest`
# skips every test ("Need at least N CUDA devices") and counts one device, while its own
# `FSDPTestMixin._run` starts CPU ranks on gloo. UPSTREAM_FSDP2_CPU_RANKS=N (the runner sets it)
# starts the ranks through that method and counts N CPU "devices", so tests that size their world
# by the device count run on N gloo ranks (those that fix their own size keep it).
_cpu_ranks = int(os.environ.get("UPSTREAM_FSDP2_CPU_RANKS", "0") or 0)
if _cpu_ranks:
    import torch as _torch
    import torch.testing._internal.common_fsdp as _cf

    if _cf.DEVICE_TYPE == "cpu":
        _cf.DEVICE_COUNT = _cpu_ranks
        _cf.FSDPTest._run = _cf.FSDPTestMixin.__dict__["_run"]  # the classmethod itself, rebound to FSDPTest
        _torch.cpu.device_count = lambda: _cpu_ranks

# Test files newer than the installed torch tag their classes with `HardwareClassification`
# (torch.testing._internal.common_utils grew it after 2.13); a tag only, so an enum of the same
# names lets those files import. Only added where torch lacks it.
if os.environ.get("UPSTREAM_FSDP2_ENGINE"):
    import enum as _enum

    import torch.testing._internal.common_utils as _cu

    if not hasattr(_cu, "HardwareClassification"):
        _cu.HardwareClassification = _enum.Enum("HardwareClassification", "GENERIC ACCELERATOR")
