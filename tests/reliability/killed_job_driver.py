"""Run by tests/reliability/test_memory_snapshots.py inside a mount namespace of its own, with a
private tmpfs on /dev/shm (`unshare -m`): a job with memory snapshots is killed whole, every process
it started SIGKILLed at once (what `scancel`, a cgroup's OOM kill or a container stop does, its
sweeper included), and something else must then remove its snapshots.

    python killed_job_driver.py <repo> <workdir> <then>...

For each `then` (a command: `refused` starts `python main.py` with memory snapshots and no restarts,
refused after its config; `cleanup` runs the launcher's cleanup command), one round: start a
torchrun job with memory snapshots in /dev/shm, wait until both ranks have committed a snapshot,
run `then` while the job lives (its segments must stay), kill the job whole, run `then` again. It
prints one JSON line per round: the names in /dev/shm at each point and the commands' statuses.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

SHM = "/dev/shm"


def _children(pid: int) -> list:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry))
    return out


def _tree(root: int) -> list:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += _children(pid)
    return found


def kill_whole(root: int) -> None:
    """SIGSTOP every process under `root` until none is left running (a stopped one neither starts
    another nor cleans up), then SIGKILL them all: nothing of the job sees another end first."""
    stopped: set = set()
    while True:
        tree = set(_tree(root)) - stopped
        if not tree:
            break
        for pid in tree:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped |= tree
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def snapshots() -> list:
    return sorted(n for n in os.listdir(SHM) if n.startswith("fwsnap-"))


def main(repo: str, workdir: str, thens: list) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=repo, OMP_NUM_THREADS="1")
    tiny = ["model=debug", "data=synthetic", "trainer.progress_bar=false", "logging.tensorboard=false"]
    tiny += ["logging.loss_plot=false", "trainer.sample_tokens=0", "checkpoint.save_final=false"]
    tiny += ["trainer.eval_interval=0", "checkpoint.memory_interval=5", "checkpoint.interval=0"]
    cmds = {
        "refused": [sys.executable, f"{repo}/main.py", *tiny, f"hydra.run.dir={workdir}/refused"],
        "cleanup": [sys.executable, f"{repo}/framework/checkpoint/shm_names.py", "--sweep", SHM],
    }
    for i, then in enumerate(thens):
        job = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1"]
        job += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"{repo}/main.py", *tiny]
        job += ["trainer.max_steps=1000000", f"hydra.run.dir={workdir}/job{i}"]
        log = open(os.path.join(workdir, f"job{i}.log"), "w")
        proc = subprocess.Popen(job, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while {p.rsplit("-r", 1)[1][:5] for p in glob.glob(f"{SHM}/fwsnap-*-r0000[01]-s*.json")} != {"00000", "00001"}:
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_whole(proc.pid)
                log.close()
                with open(os.path.join(workdir, f"job{i}.log")) as f:
                    print(json.dumps({"error": f"no snapshots (status {proc.poll()})", "log": f.read()[-3000:]}))
                return
            time.sleep(0.2)
        round_ = {"then": then, "live": snapshots()}
        during = subprocess.run(cmds[then], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
        round_.update(during_status=during.returncode, during_err=during.stderr[-2000:], after_live=snapshots())
        kill_whole(proc.pid)
        proc.wait()
        log.close()
        time.sleep(1.0)  # nothing of the job runs any more: what is left stays
        round_["killed"] = snapshots()
        after = subprocess.run(cmds[then], cwd=workdir, env=env, capture_output=True, text=True, timeout=120)
        round_.update(status=after.returncode, err=after.stderr[-2000:], out=after.stdout[-2000:], left=snapshots())
        print(json.dumps(round_), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
