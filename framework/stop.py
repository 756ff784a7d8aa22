"""When a run stops early: a pre-emption signal (SIGTERM, Slurm's SIGUSR1) or the time limit.

The trainer asks `StopPolicy.should_stop(step)` once per step, whether or not checkpoints are on.
What happens then is the trainer's business (save if a checkpoint manager exists, then exit with
`EXIT_REQUEUE`); this module only decides, and makes every rank decide the same.

[Note: ranks agree to stop]
A signal may reach one rank only (a `kill` of one pid, a node's agent), and wall clocks differ a
little between ranks. If each rank decided alone, one would leave the training loop while the
others wait for it in the next step's collectives. So every step each rank contributes two flags
(signalled, past the time limit) to one tiny all-reduce with MAX: all ranks see the same result and
stop after the same step. The flags are host values and stay in host memory, reduced by the host
half of the process group (gloo: a CPU run's whole group, a GPU run's `cpu:gloo,cuda:nccl`), so
the check never waits for the device ([Note: the host reads the device on log steps only] in
framework/metrics.py).
"""

from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from framework.runtime import note_step

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopPolicy:
    """Signal handlers plus the time limit; `close()` restores the previous handlers."""

    def __init__(self, *, max_time_minutes: float, rank: int, device: torch.device):
        self.max_time_minutes = max_time_minutes
        self.rank = rank
        self.device = device
        self.started = time.monotonic()
        self.signal_name: str | None = None  # the first stop signal this rank received
        self.reason = ""  # why the ranks agreed to stop (set by should_stop)
        self._previous: dict[int, object] = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum, _frame) -> None:
        # A signal handler must never raise: it runs between any two bytecodes of the loop.
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            try:
                print(
                    f"rank {self.rank}: received {self.signal_name}; stopping after this step",
                    file=sys.stderr,
                    flush=True,
                )
            except RuntimeError:  # the signal interrupted another write to stderr (reentrant call)
                pass

    def past_time_limit(self) -> bool:
        minutes = self.max_time_minutes
        return bool(minutes) and time.monotonic() - self.started > 60 * minutes

    def should_stop(self, step: int) -> bool:
        """True on every rank when any rank was signalled or is past the time limit. One collective
        per call; every rank must call it at the same step. See [Note: ranks agree to stop]."""
        note_step(step)
        flags = [1.0 if self.signal_name else 0.0, 1.0 if self.past_time_limit() else 0.0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flags = torch.tensor(flags, device="cpu" if "cpu:" in dist.get_backend_config() else self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            flags = flags.tolist()
        signalled, late = (bool(f) for f in flags)
        if not (signalled or late):
            return False
        if signalled:
            self.reason = f"signal {self.signal_name}" if self.signal_name else "a signal on another rank"
        else:
            self.reason = f"trainer.max_time_minutes={self.max_time_minutes} reached"
        return True

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
