"""Test-only fault injection, loaded by every Python process of a test run that puts this folder
on PYTHONPATH (main.py, the ranks it spawns, torchrun's workers). Nothing in the framework knows
about it.

FRAMEWORK_TEST_FAULT=<kind>:<rank>:<call>[:<attempt>][,<another fault>...] makes the loss computation
of that rank, at its <call>-th call of cross_entropy in that process (the step, when each step
computes the loss once and nothing else does), do <kind>:
  runtime  raise RuntimeError     oserror  raise OSError       kill  SIGKILL itself
  refuse   raise the framework's UserInputError (bad input found by that rank only)
  wipe     remove every file in FRAMEWORK_TEST_SNAPSHOT_DIR (the node's snapshots), then SIGKILL itself
  corrupt  flip one byte of that rank's newest committed in-memory snapshot (in the directory
           FRAMEWORK_TEST_SNAPSHOT_DIR), then SIGKILL itself
  corruptheld  flip one byte of the newest copy that rank holds for another node's rank (and go on)
<attempt> (default 0) is torchrun's restart count the fault happens in (other attempts run clean);
g<n> names the attempt by the generation its ranks meet in instead (framework/runtime.py: under a
c10d rendezvous the nodes' restart counts differ, see [Note: one store, many attempts]).

FRAMEWORK_TEST_MEASURE_SNAPSHOTS=<directory> measures what the snapshot code allocates: from the
rank's first loss on, every tensor the snapshot code (framework/checkpoint/memory.py and the
snapshot_*.py modules it puts together) makes with torch.empty is
counted while it lives, and at every loss the bytes of the `.data` files in
FRAMEWORK_TEST_SNAPSHOT_DIR; the peaks go to <directory>/rank<N>.json as they rise.
"""

import os

_measure = os.environ.get("FRAMEWORK_TEST_MEASURE_SNAPSHOTS", "")
if _measure:
    import json
    import sys
    import weakref

    import torch
    import torch.nn.functional as F

    _peaks = {"tensors": 0, "memory_dir": 0}
    _live = [0]

    def _record(key, value):
        if value > _peaks[key]:
            _peaks[key] = value
            with open(os.path.join(_measure, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump(_peaks, f)

    def _freed(nbytes):
        _live[0] -= nbytes

    class _CountingTorch:
        """torch as the snapshot code sees it: torch.empty counted, the rest as is."""

        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *args, **kwargs):
            t = torch.empty(*args, **kwargs)
            nbytes = t.numel() * t.element_size()
            _live[0] += nbytes
            weakref.finalize(t, _freed, nbytes)
            _record("tensors", _live[0])
            return t

    _measured_cross_entropy = F.cross_entropy

    def _measuring_cross_entropy(*args, **kwargs):
        for name, module in list(sys.modules.items()):
            snapshot_code = name == "framework.checkpoint.memory" or name.startswith("framework.checkpoint.snapshot_")
            if snapshot_code and hasattr(module, "torch") and not isinstance(module.torch, _CountingTorch):
                module.torch = _CountingTorch()
        d = os.environ["FRAMEWORK_TEST_SNAPSHOT_DIR"]
        sizes = 0
        for name in os.listdir(d):
            if name.endswith(".data"):
                try:
                    sizes += os.path.getsize(os.path.join(d, name))
                except OSError:
                    pass
        _record("memory_dir", sizes)
        return _measured_cross_entropy(*args, **kwargs)

    F.cross_entropy = _measuring_cross_entropy

_spec = os.environ.get("FRAMEWORK_TEST_FAULT", "")
if _spec:
    import signal

    import torch.nn.functional as F

    _faults = []
    for _one in _spec.split(","):
        _parts = _one.split(":")
        _faults.append((_parts[0], _parts[1], int(_parts[2]), _parts[3] if len(_parts) > 3 else "0"))
    _original = F.cross_entropy
    _calls = [0]

    def _faulty_cross_entropy(*args, **kwargs):
        _calls[0] += 1
        for kind, rank, call, attempt in _faults:
            if attempt.startswith("g"):
                from framework import runtime

                now = runtime.attempt() == f"generation_{attempt[1:]}"
            else:
                now = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == attempt
            if os.environ.get("RANK") == rank and _calls[0] == call and now:
                if kind == "runtime":
                    raise RuntimeError(f"injected fault on rank {rank} at call {call}")
                if kind == "oserror":
                    raise OSError(28, "No space left on device (injected)")
                if kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "wipe":  # the node's memory is lost with it
                    d = os.environ["FRAMEWORK_TEST_SNAPSHOT_DIR"]
                    for name in os.listdir(d):
                        os.unlink(os.path.join(d, name))
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "corrupt":
                    _corrupt_newest_snapshot(rank)
                    os.kill(os.getpid(), signal.SIGKILL)
                if kind == "corruptheld":  # the copy this rank holds for another node's rank
                    _corrupt_newest_snapshot(rank, kind="p", owner="*")
                if kind == "refuse":
                    from framework.errors import UserInputError

                    raise UserInputError(f"injected refusal on rank {rank}")
        return _original(*args, **kwargs)

    def _corrupt_newest_snapshot(rank, kind="r", owner=None):
        import glob
        import time

        who = owner or f"{int(rank):05d}"
        pattern = os.path.join(os.environ["FRAMEWORK_TEST_SNAPSHOT_DIR"], f"fwsnap-*-{kind}{who}-s*.data")
        deadline = time.monotonic() + 20
        while True:  # the newest one's manifest: written last, once the writer thread is done
            newest = max(glob.glob(pattern), default=None)
            if newest and os.path.exists(newest[: -len(".data")] + ".json") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        with open(newest, "r+b") as f:
            f.seek(os.path.getsize(newest) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))

    F.cross_entropy = _faulty_cross_entropy
