"""A one-node Slurm cluster on this machine, for the launcher's real-Slurm test.

Starts munged, slurmctld and slurmd (Debian's slurm-wlm) as root with every file in a temporary
directory: its own munge socket, state and spool directories, and a slurm.conf naming this host
(`hostname -s`) as the only node, or several nodes, each its own slurmd on this machine.
`SLURM_CONF` in the returned environment points the client commands (sbatch, squeue, sacct, scontrol) at it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tests.conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo")
MUNGE_KEY = "/etc/munge/munge.key"


def missing() -> Optional[str]:
    """Why the Slurm tests skip here: the binaries are not installed, or this is not root; None
    where they run (CI: root, slurm-wlm installed by .ci/run). There anything else that stops the
    cluster (no munge key, a node name that does not resolve) fails the test: see `start`."""
    for tool in DAEMONS + CLIENTS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not installed (apt-get install -y slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


# cred_expire: a requeued job may start again only this many seconds after it ended (default 120;
# Slurm's minimum is 5); kept short so the pre-emption test's requeue runs promptly.
SLURM_CONF = """\
ClusterName=launchertest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Poll often: a requeued job waits for its BeginTime, and only a scheduling pass notices it passed.
SchedulerParameters=bf_interval=1,sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# The node may declare more CPUs than this machine has (two test jobs side by side on 2 cores).
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
{node_lines}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
# Every node is a slurmd on this machine (NodeAddr 127.0.0.1, its own port); a node's name must
# resolve here, since torchrun's rendezvous endpoint is the first node's name.
NODE_LINE = "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"


@dataclass
class SlurmCluster:
    root: str
    env: Dict[str, str]
    procs: List[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=30)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def logs(self) -> str:
        parts = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith(".log"):
                with open(os.path.join(self.root, name)) as f:
                    parts.append(f"--- {name}\n" + f.read()[-3000:])
        return "\n".join(parts)

    def wait_idle(self, nodes: int, timeout: float = 30.0) -> None:
        """Until every node is schedulable."""
        deadline = time.time() + timeout
        states: List[str] = []
        while time.time() < deadline:
            states = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).split()
            if len(states) == nodes and all(s == "idle" for s in states):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm nodes never became idle (states {states})\n{self.logs()}")

    def job_state(self, job_id: str) -> str:
        """The job's state from scontrol (kept for MinJobAge after it ends)."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        for token in out.split():
            if token.startswith("JobState="):
                return token.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float) -> str:
        deadline = time.time() + timeout
        state = ""
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state in (
                "COMPLETED",
                "FAILED",
                "CANCELLED",
                "TIMEOUT",
                "NODE_FAIL",
                "OUT_OF_MEMORY",
                "BOOT_FAIL",
                "DEADLINE",
                "PREEMPTED",
            ):
                return state
            time.sleep(1.0)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"Slurm job {job_id} still {state} after {timeout:.0f}s\n{self.logs()}")

    def stop(self) -> None:
        """Cancel what is left of the test's jobs (their steps too), then stop the daemons."""
        if self.procs and self.procs[-1].poll() is None:
            try:
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
                for job_id in jobs:
                    self.run("scancel", job_id, check=False)
                deadline = time.time() + 20
                while jobs and time.time() < deadline:
                    jobs = self.run("squeue", "-h", "-o", "%i", check=False).split()
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def local_host() -> str:
    return socket.gethostname().split(".")[0]


def unresolvable(names: List[str]) -> Optional[str]:
    for name in names:
        try:
            socket.gethostbyname(name)
        except OSError:
            return f"node name {name!r} does not resolve on this machine"
    return None


def start(root: str, cpus: int = 2, nodes: Optional[List[str]] = None) -> SlurmCluster:
    """Start munged, slurmctld and one slurmd per node, in the foreground (children of this
    process), every file under `root`. `nodes` defaults to this host's short name alone. A machine
    that has Slurm and root but cannot run it is refused here, before any daemon starts."""
    host = local_host()
    nodes = nodes or [host]
    if not os.path.exists(MUNGE_KEY):
        raise RuntimeError(f"{MUNGE_KEY} missing (the munge package creates it)")
    why = unresolvable(nodes)
    if why:
        raise RuntimeError(why)
    for sub in ("state", "munge", *(f"spool-{n}" for n in nodes)):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    munge_socket = os.path.join(root, "munge", "munge.socket")
    conf = os.path.join(root, "slurm.conf")
    node_lines = "\n".join(NODE_LINE.format(name=n, host=host, port=free_port(), cpus=cpus) for n in nodes)
    with open(conf, "w") as f:
        f.write(
            SLURM_CONF.format(
                host=host,
                root=root,
                munge_socket=munge_socket,
                ctld_port=free_port(),
                node_lines=node_lines,
                node_list=",".join(nodes),
            )
        )
    env = dict(os.environ, SLURM_CONF=conf)
    cluster = SlurmCluster(root=root, env=env)
    try:
        cluster.procs.append(
            subprocess.Popen(
                [
                    _daemon("munged"),
                    "--foreground",
                    "--force",
                    f"--socket={munge_socket}",
                    f"--key-file={MUNGE_KEY}",
                    f"--pid-file={root}/munge/munged.pid",
                    f"--log-file={root}/munged.log",
                    f"--seed-file={root}/munge/munged.seed",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        deadline = time.time() + 10
        while not os.path.exists(munge_socket):
            if time.time() > deadline or cluster.procs[0].poll() is not None:
                raise RuntimeError(f"munged did not start\n{cluster.logs()}")
            time.sleep(0.1)
        cluster.procs.append(
            subprocess.Popen(
                [_daemon("slurmctld"), "-D", "-i", "-f", conf],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        for name in nodes:
            cluster.procs.append(
                subprocess.Popen(
                    [_daemon("slurmd"), "-D", "-f", conf, "-N", name],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        cluster.wait_idle(len(nodes))
    except Exception:
        cluster.stop()
        raise
    return cluster
