"""A Kubernetes pod's entry: run torchrun, then exit with a status the training operator's
`ExitCode` restart policy reads correctly.

[Note: exit codes in a pod]
Kubeflow's ExitCode policy treats exit codes 1-127 as permanent (the job fails) and 128-255 as
retryable (the pod is restarted, and the job resumes with checkpoint.resume=auto). torchrun itself
exits 1 whenever a rank fails, whatever the rank's own status, so each rank appends its status to
the file named by FRAMEWORK_STATUS_FILE (framework.errors.record_status) and this entry decides:
- every rank finished (torchrun 0): 0;
- a rank refused its input (2) or stopped on a diverged loss (3): that status: permanent, since a
  restart would only fail the same way;
- a stop for pre-emption or the time limit (75), a crash, a signal: 128 + the status (75 -> 203,
  a crash 1 -> 129): retryable, the restarted pod resumes from the latest checkpoint.
SIGTERM and SIGINT (pod deletion, eviction) are passed on to torchrun, which passes them to the
ranks: they save and exit 75. Before torchrun starts and once it has ended, however it ended, the
entry removes the memory snapshots in /dev/shm of jobs that no longer run (a container restarted
in its pod keeps the pod's /dev/shm: [Note: snapshot segments outlive the rank, not the job] in
framework/checkpoint/shm_names.py).

    python -m launcher_scripts.pod_entry python -m torch.distributed.run ... main.py ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from typing import List

PERMANENT = (2, 3)  # framework.errors: EXIT_BAD_INPUT, EXIT_DIVERGED
REQUEUE = 75  # framework.errors.EXIT_REQUEUE


def pod_status(torchrun_status: int, rank_statuses: List[int]) -> int:
    """The pod's exit status from torchrun's and the ranks' (see the Note above)."""
    if torchrun_status == 0:
        return 0
    for status in PERMANENT:
        if status in rank_statuses:
            return status
    if REQUEUE in rank_statuses:
        return 128 + REQUEUE
    if torchrun_status < 0:  # torchrun itself ended by a signal
        return 128 + min(-torchrun_status, 127)
    return 128 + torchrun_status if torchrun_status < 128 else torchrun_status


def read_statuses(path: str) -> List[int]:
    try:
        with open(path) as f:
            return [int(line.split()[-1]) for line in f if line.strip() and line.split()[-1].lstrip("-").isdigit()]
    except OSError:
        return []


def sweep_snapshots() -> None:
    """This uid's memory snapshots in /dev/shm whose job is gone, by framework/checkpoint/shm_names.py
    loaded on its own (standard library only: the launcher imports no torch)."""
    import importlib.util

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "framework", "checkpoint", "shm_names.py"
    )
    spec = importlib.util.spec_from_file_location("_shm_names", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.sweep_job_start()


def main(argv: List[str]) -> int:
    if not argv:
        print("usage: python -m launcher_scripts.pod_entry <command...>", file=sys.stderr)
        return 2
    sweep_snapshots()
    fd, path = tempfile.mkstemp(prefix="framework-status-")
    os.close(fd)
    child = subprocess.Popen(argv, env={**os.environ, "FRAMEWORK_STATUS_FILE": path})

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, forward)
    status = child.wait()
    sweep_snapshots()  # the job's own, now that torchrun (their creator) has ended
    statuses = read_statuses(path)
    os.remove(path)
    final = pod_status(status, statuses)
    if final != status:
        print(f"pod exit status {final} (torchrun {status}, ranks {sorted(set(statuses))})", file=sys.stderr)
    return final


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
