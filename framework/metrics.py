"""The step's numbers: kept on the device between the host's reads (`LossWatch`, with the
finite-loss check), and rank 0's reporting of them: a progress bar, metrics.jsonl in the run
directory, the trackers (framework/trackers.py) and loss.png.

[Note: the host reads the device on log steps only]
On a GPU, reading a device value (`.item()`, `float(t)`, `.tolist()`, a CUDA event's
`synchronize`) makes the host wait until the device has run everything queued before it, so the
host cannot queue the next step's kernels while this one runs. The training step therefore keeps
its numbers on the device: the loss (the world mean, one all-reduce on the device), the gradient
norm, and the finite-loss check, which records the first step whose loss was not finite, and that
loss, with device operations only (`torch.where`). The host reads them all at once (one
`.tolist()`) before the optimizer step of the steps that read anyway: log steps
(`trainer.log_interval`), evaluations, checkpoints and the last step. So a non-finite loss stops
the job at the next such step at the latest, naming the step where it happened; with
`trainer.log_interval=1` (the default) that is the step itself, before its optimizer step.
A checkpoint is written only after a read, so none holds a state past a non-finite loss.
The engine's communication counters are read on log steps too (`CommStats.resolve`, which
synchronizes on CUDA); resetting them each step does not wait.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Dict, List, Optional, Tuple

import torch

from framework.fileio import create_temporary, open_append, open_regular

# Dense bf16 peak TFLOP/s per device, for MFU. Unknown devices (any CPU) report no MFU.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device: torch.device, configured: float) -> Optional[float]:
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_TFLOPS.items() if key in name), None)


def throughput(
    step_time_s: float, tokens_per_step: int, flops_per_token: float, world_size: int, peak_tflops: Optional[float]
) -> Dict[str, float]:
    """One step's speed: tokens/s over the job, achieved TFLOP/s per device, and MFU against the
    device's peak when it is known."""
    achieved = flops_per_token * tokens_per_step / step_time_s / world_size / 1e12
    out = {"step_time_s": step_time_s, "tokens_per_s": tokens_per_step / step_time_s, "tflops_per_device": achieved}
    if peak_tflops:
        out["mfu"] = achieved / peak_tflops
    return out


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class TrainingDiverged(RuntimeError):
    """A non-finite loss: the job ends with EXIT_DIVERGED and this message."""


class LossWatch:
    """One rank's view of the steps since the last read (the same on every rank: the loss it
    watches is the world mean)."""

    def __init__(self, device: torch.device, log_interval: int):
        self.log_interval = log_interval
        # The first step whose loss was not finite (0: none yet), and that loss; float64 holds
        # every step number exactly.
        self._first_bad = torch.zeros((), dtype=torch.float64, device=device)
        self._bad_loss = torch.zeros((), dtype=torch.float64, device=device)
        self._last: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # the last step's (loss, grad norm)

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record `step`'s loss and gradient norm: device operations only, nothing waits."""
        loss = loss.detach().to(torch.float64)
        new = torch.logical_and(~torch.isfinite(loss), self._first_bad == 0)
        self._first_bad = torch.where(new, float(step), self._first_bad)
        self._bad_loss = torch.where(new, loss, self._bad_loss)
        self._last = (loss, grad_norm.detach().to(loss.device, torch.float64))

    def read(self, step: int, before_optimizer_step: bool = True) -> Tuple[float, float]:
        """The host's one read at `step`: the last observed step's (loss, gradient norm). Raises
        `TrainingDiverged` naming the first step whose loss was not finite, if any was."""
        loss, norm = self._last if self._last is not None else (self._bad_loss, self._bad_loss)
        loss_value, norm_value, first_bad, bad_loss = torch.stack(
            [loss, norm, self._first_bad, self._bad_loss]
        ).tolist()
        if first_bad:
            bad = int(first_bad)
            if bad == step and before_optimizer_step:
                raise TrainingDiverged(
                    f"loss is {bad_loss} at step {bad}; stopping before the optimizer step (no checkpoint "
                    "of this state is written). Lower optimizer.lr or enable optimizer.clip_grad_norm"
                )
            raise TrainingDiverged(
                f"loss is {bad_loss} at step {bad}, found at step {step} (the loss is read on log steps, "
                f"every trainer.log_interval={self.log_interval} steps, and before evaluations and "
                f"checkpoints); stopping with no checkpoint after step {bad - 1}. Lower optimizer.lr or "
                "enable optimizer.clip_grad_norm"
            )
        return loss_value, norm_value


def _drop_steps_after(path: str, step: int) -> None:
    """A run resumed at `step` (after a crash, a requeue or a restart) redoes the steps after it:
    their records from the attempt that did not finish (and a last line a crash cut short) are dropped,
    so every step appears once and the file reads like an uninterrupted run's. The file is replaced atomically."""
    if not os.path.lexists(path):
        return
    with os.fdopen(open_regular(path, os.O_RDONLY)) as handle:  # a planted link is refused, not read
        lines = handle.readlines()
    keep = [line for line in lines if line.endswith("\n") and _step_of(line) <= step]
    if len(keep) == len(lines):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with create_temporary(tmp) as handle:
        handle.writelines(keep)
    os.replace(tmp, path)


def _losses_in(path: str) -> List[Dict[str, object]]:
    """step, loss and val_loss of each complete record in metrics.jsonl (after a resume's cut)."""
    out = []
    with os.fdopen(open_regular(path, os.O_RDONLY | os.O_CREAT)) as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append({k: record[k] for k in ("step", "loss", "val_loss") if k in record})
    return out


def _step_of(line: str) -> float:
    """The record's step; a line cut short by a crash (not JSON) counts as after every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    """Writes on rank 0 only; every other rank gets a logger that does nothing."""

    def __init__(
        self,
        run_dir: str,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        jsonl: bool,
        progress_bar: Optional[bool],
        log_interval: int = 1,
        trackers=None,
        loss_plot: bool = False,
        tokens_per_step: int = 0,
    ):
        self.enabled = enabled
        self._jsonl = self._bar = None
        self._trackers = trackers  # framework.trackers.Trackers (rank 0), or None
        self._plot = loss_plot and enabled
        self._run_dir, self._tokens_per_step = run_dir, tokens_per_step
        self.history: List[Dict[str, object]] = []  # step, loss and val_loss of every record, for loss.png
        # no terminal (a batch job's log file): lines instead of a bar that rewrites one line
        self._lines = progress_bar is None and not sys.stderr.isatty()
        self._step, self._total, self._every = start_step, total_steps, max(1, log_interval)
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if jsonl:
            path = os.path.join(run_dir, "metrics.jsonl")
            _drop_steps_after(path, start_step)
            self.history = _losses_in(path)  # a resumed run's picture starts at step 1
            self._jsonl = open_append(path, buffering=1)  # never through a planted link
        if progress_bar or (progress_bar is None and not self._lines):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=0.5
            )

    def log(self, step: int, values: Dict[str, float]) -> None:
        if not self.enabled:
            return
        # Non-finite numbers become null: NaN is not JSON, and strict readers refuse it.
        record = {
            "step": step,
            **{
                k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                for k, v in values.items()
                if v is not None
            },
        }
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._plot:
            self.history.append({k: record[k] for k in ("step", "loss", "val_loss") if k in record})
        if self._trackers is not None:
            self._trackers.log(step, {k: v for k, v in record.items() if k != "step"})

    def plot(self) -> None:
        """Write `<run>/loss.png` from every record so far (at checkpoints and at the end)."""
        if not self._plot:
            return
        from framework.loss_plot import write_loss_plot

        try:
            write_loss_plot(self.history, self._tokens_per_step, os.path.join(self._run_dir, "loss.png"))
        except Exception as exc:  # noqa: BLE001 - a picture never ends a training run
            self._plot = False
            self.write(f"warning: loss.png not written ({type(exc).__name__}: {exc}); metrics.jsonl has every step")

    def progress(self, values: Dict[str, float]) -> None:
        self._step += 1
        if self._lines and self.enabled and (self._step % self._every == 0 or self._step == self._total):
            shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
            print(f"step {self._step}/{self._total}: {shown}", file=sys.stderr, flush=True)
        if self._bar is not None:
            self._bar.set_postfix(
                {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in values.items()}, refresh=False
            )
            self._bar.update(1)

    def write(self, message: str) -> None:
        """A line for the user that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        for handle in (self._bar, self._trackers, self._jsonl):
            if handle is not None:
                handle.close()
        self._jsonl = self._trackers = self._bar = None
