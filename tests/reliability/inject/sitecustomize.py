"""Test-only fault injection, loaded by every Python process of a test run that puts this folder
on PYTHONPATH (main.py, the ranks it spawns, torchrun's workers). Nothing in the framework knows
about it.

FRAMEWORK_TEST_FAULT=<kind>:<rank>:<step>[:<attempt>] makes the loss computation of that rank, at
that step (counting its calls of cross_entropy in training), do <kind>:
  runtime  raise RuntimeError     oserror  raise OSError       kill  SIGKILL itself
<attempt> (default 0) is torchrun's restart count the fault happens in (later attempts run clean).
"""
import os

_spec = os.environ.get("FRAMEWORK_TEST_FAULT", "")
if _spec:
    import signal

    import torch.nn.functional as F

    _parts = _spec.split(":")
    _kind, _rank, _step = _parts[0], _parts[1], int(_parts[2])
    _attempt = _parts[3] if len(_parts) > 3 else "0"
    _original = F.cross_entropy
    _calls = [0]

    def _faulty_cross_entropy(*args, **kwargs):
        if os.environ.get("RANK") == _rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == _attempt:
            _calls[0] += 1
            if _calls[0] == _step:
                if _kind == "runtime":
                    raise RuntimeError(f"injected fault on rank {_rank} at call {_step}")
                if _kind == "oserror":
                    raise OSError(28, "No space left on device (injected)")
                if _kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
        return _original(*args, **kwargs)

    F.cross_entropy = _faulty_cross_entropy
