"""Launch a training job on this machine, on Slurm or on Kubernetes from the composed config.

    python launcher_scripts/main.py cluster=slurm cluster.nodes=4 model=llama_7b parallelism.tp=2 \\
        container.runtime=pyxis container.image=registry.example/org/train:1.0
    python launcher_scripts/main.py status|logs|cancel <job dir>

Composes the training config exactly as main.py would (world size = cluster.nodes x
cluster.nproc_per_node) and the launcher's own (launcher_scripts/conf/), validates both and refuses
a job that cannot start (each problem on one `error:` line, exit 2, nothing written). Otherwise
writes the job's directory under cluster.jobs_dir (scripts or manifest, config.yaml for main.py,
launcher.yaml, submit.sh: the exact submit command) and runs submit.sh, unless dry_run=true. The
last line on stdout is the job's directory.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, this folder is sys.path[0]: put the repository there instead, so `framework` and
# `launcher_scripts` import and our module names (job, local, ...) shadow nothing.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, REPO)

from framework.errors import EXIT_BAD_INPUT  # noqa: E402  (no torch: the launcher's statuses are the job's)
from launcher_scripts.backends import backend_of  # noqa: E402
from launcher_scripts.lifecycle import ACTIONS, lifecycle_commands, read_job  # noqa: E402
from launcher_scripts.plan import Plan, Refused, make_job, plan, render_job  # noqa: E402


def _new_job_dir(jobs_dir: str, name: str) -> str:
    path, n = os.path.join(jobs_dir, name), 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = os.path.join(jobs_dir, f"{name}-{n}")


def write_job(p: Plan, argv: Sequence[str], now: Optional[float] = None) -> str:
    """Create the job's directory and write every file of it; returns the directory."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    jobs_dir = os.path.abspath(p.launch.cluster.jobs_dir)
    job_dir = _new_job_dir(jobs_dir, f"{p.launch.cluster.job_name}-{stamp}".lower())
    job = make_job(p, job_dir, REPO, sys.executable)
    files: Dict[str, str] = render_job(p, job, job_dir)
    files["launcher.txt"] = shlex.join([sys.executable, "launcher_scripts/main.py", *argv]) + "\n"
    os.makedirs(os.path.join(job_dir, "logs"), exist_ok=True)
    for name, text in files.items():
        path = os.path.join(job_dir, name)
        with open(path, "w") as f:
            f.write(text)
        if name.endswith((".sh", ".sbatch")):
            os.chmod(path, 0o755)
    return job_dir


def submit(p: Plan, job_dir: str) -> int:
    """Run the job's submit.sh: sbatch, kubectl apply, or the local run itself."""
    script = os.path.join(job_dir, "submit.sh")
    backend = backend_of(p.launch.cluster.type)
    tool = backend.submit_tool
    if tool and shutil.which(tool) is None:
        print(
            f"{tool} not found here; the job is written: submit it with `bash {script}` where {tool} is available",
            file=sys.stderr,
        )
        return backend.missing_tool_status
    sys.stdout.flush()
    return subprocess.call(["bash", script])


def lifecycle(action: str, job_dir: str) -> int:
    """`status`, `logs` or `cancel` of a written job; the status of the last command run."""
    if not os.path.isfile(os.path.join(job_dir, "launcher.yaml")):
        print(
            f"error: {job_dir!r} is not a job directory written by the launcher (no launcher.yaml); give "
            "the directory the launcher printed last",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    job = read_job(job_dir)
    commands = lifecycle_commands(action, job["backend"], job["name"], job["job_dir"], job["ids"], job["namespace"])
    if not commands:
        print(
            f"error: {action} is not available for a job on this machine: it runs in the foreground of "
            "its submit.sh; stop that process (Ctrl-C)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    rc = 0
    for command in commands:
        print(f"$ {shlex.join(command)}", flush=True)
        try:
            rc = subprocess.call(command)
        except FileNotFoundError:
            print(f"{command[0]} not found here", file=sys.stderr)
            rc = 127
    return rc


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nSee docs/launcher.md.")
        return 0
    if argv and argv[0] in ACTIONS:
        if len(argv) != 2:
            print(f"error: usage: python launcher_scripts/main.py {argv[0]} <job dir>", file=sys.stderr)
            return EXIT_BAD_INPUT
        return lifecycle(argv[0], argv[1])
    # Advice from the config checks (a job that can start but may not be what you want).
    logging.basicConfig(format="launcher: warning: %(message)s", level=logging.WARNING, stream=sys.stderr)
    try:
        p = plan(argv)
    except Refused as refused:
        for problem in refused.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    job_dir = write_job(p, argv)
    print(f"wrote {job_dir}: {', '.join(sorted(os.listdir(job_dir)))}")
    if p.launch.dry_run:
        print(f"dry run: nothing submitted; submit with `bash {job_dir}/submit.sh`")
        rc = 0
    else:
        rc = submit(p, job_dir)
    print(job_dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
