"""The launcher's own typed config: where and how the job runs, never what it trains.

The training job never sees any of this: `main.py` gets the training overrides only. What training
needs of the machines (the shape: `cluster.nodes`, `cluster.nproc_per_node`, `cluster.gpus_per_node`
and the planner's device fields) stays in the training schema (`framework/config/schema.py`,
`conf/cluster/`); everything else about a backend lives here, one dataclass per backend
(`launcher_scripts/conf/cluster/{local,slurm,k8s}.yaml` hold their defaults), plus the container
and `dry_run`.

On the command line both are typed together (`cluster=slurm cluster.nodes=4 cluster.partition=batch
container.image=...`); `split_overrides` sends each override to its side: a `cluster.<field>` of
the training schema goes to training, any other `cluster.*`, `container*` and `dry_run` to the
launcher, the `cluster=<backend>` choice to both.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import MISSING, DictConfig, OmegaConf

from framework.config import ClusterConfig, Stage
from framework.errors import UserInputError

CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")


class Backend(str, Enum):
    local = "local"
    slurm = "slurm"
    k8s = "k8s"


class ContainerRuntime(str, Enum):
    none = "none"
    pyxis = "pyxis"  # Slurm + enroot: srun --container-image
    apptainer = "apptainer"  # Slurm or this machine
    docker = "docker"  # this machine only
    podman = "podman"  # this machine only


# Names that end up in #SBATCH lines: no spaces, quotes or shell syntax.
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,+-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}")
# An env var whose name says it holds a credential must come by reference (cluster.secret_env).
SECRET_LIKE = re.compile(r"(^|_)(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|PRIVATE_KEY)($|_)")
# Kubernetes' own name rules (k8s.io/apimachinery validation): RFC 1035 labels for objects that get
# a Service (the PyTorchJob and its pods), RFC 1123 labels for namespaces, subdomains for Secrets,
# service accounts and priority classes.
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
K8S_QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-_.A-Za-z0-9]*[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-_.A-Za-z0-9]{0,61}[A-Za-z0-9])?)?")
SLURM_MEM = re.compile(r"\d+[KMGT]?")


def _bad(message: str) -> UserInputError:
    return UserInputError(" ".join(message.split()))


@dataclass
class ContainerConfig:
    runtime: ContainerRuntime = ContainerRuntime.none  # pyxis/apptainer: Slurm; docker/podman: local
    image: str = ""  # registry/org/name:tag (pyxis, docker, podman, k8s) or a .sif / docker:// (apptainer)
    mounts: List[str] = field(default_factory=list)  # host:container[:flags]
    workdir: str = "/workspace"  # where the image holds the project (its main.py)
    # Mount data.paths, data.cache_dir, checkpoint.dir and checkpoint.init_from at their own paths when
    # they are absolute host paths, so the job sees them where the config says.
    auto_mounts: bool = True

    def __post_init__(self) -> None:
        try:
            self.runtime = ContainerRuntime(self.runtime)
        except ValueError:
            raise _bad(
                f"container.runtime={self.runtime!r}: unknown; choose one of "
                f"{', '.join(r.value for r in ContainerRuntime)}"
            ) from None
        for mount in self.mounts:
            if mount.count(":") not in (1, 2) or "," in mount or not mount.startswith("/"):
                raise _bad(
                    f"container.mounts: {mount!r}: write /host/path:/container/path[:flags], one mount per entry"
                )
        if not self.workdir.startswith("/"):
            raise _bad(f"container.workdir={self.workdir!r}: must be an absolute path in the image")


@dataclass
class ClusterBase:
    """What every backend has. The job's shape (nodes, ranks and GPUs per node) is the training
    config's `cluster` section; the launcher reads it from there."""

    type: Backend = Backend.local
    job_name: str = "train"  # the job directory is <jobs_dir>/<job_name>-<YYYYmmdd-HHMMSS>
    jobs_dir: str = "jobs"  # where the launcher writes each job's directory
    env: Dict[str, str] = field(default_factory=dict)  # extra environment for the job (no secrets)
    nccl_env: Dict[str, str] = field(default_factory=dict)  # NCCL_* settings, written into the job
    # Secrets by reference only, never by value: VAR -> where the job takes it from. Slurm/local: the
    # name of a variable in the submitting environment; k8s: "secret-name/key" of a Secret.
    secret_env: Dict[str, str] = field(default_factory=dict)
    stages: List[str] = field(default_factory=list)  # run these stages in order (empty: just `stage`)
    derive_mesh: bool = False  # mesh from the cluster shape: dp_replicate=nodes, dp_shard=nproc/tp
    # torchrun: c10d rendezvous port; 0 derives it from the job id (Slurm) or the job name (local), so
    # two jobs on one head node never join each other's store. Kubernetes pods have their own network.
    rdzv_port: int = 0
    rdzv_join_timeout_s: int = 900  # how long the first agent waits for the others (slow image pulls)
    # torchrun restarts the whole group this many times after a rank dies; every start resumes from
    # the latest checkpoint (checkpoint.resume=auto).
    max_restarts: int = 3
    rank_logs: bool = False  # one log file per rank under <job dir>/logs/ranks (torchrun --log-dir --tee)
    local_ranks_filter: str = ""  # torchrun --local-ranks-filter: e.g. "0" shows only local rank 0
    # Seconds between the stop signal and the kill: the ranks' time to save. Slurm: the warning
    # before the time limit (--signal=B:USR1@N); Kubernetes: terminationGracePeriodSeconds.
    # torchrun's --shutdown-timeout is this minus a margin (its default, 30 s, would cut the save short).
    signal_seconds: int = 120
    force: bool = False  # submit even when the planner predicts the job will not fit
    cpus_per_task: int = 0  # CPUs for each node's torchrun agent and its ranks (0: the backend's default)
    mem: str = ""  # memory per node (Slurm: --mem, "" on a GPU job: 0 = all; k8s: request and limit)

    def __post_init__(self) -> None:
        self.type = Backend(self.type)
        for name in ("rdzv_port", "rdzv_join_timeout_s", "max_restarts", "signal_seconds", "cpus_per_task"):
            if getattr(self, name) < 0:
                raise _bad(f"cluster.{name}={getattr(self, name)}: must be >= 0")
        if self.rdzv_port > 65535:
            raise _bad(f"cluster.rdzv_port={self.rdzv_port}: choose a port in 1..65535 (0: derived)")
        if not self.job_name:
            raise _bad("cluster.job_name is empty; give the job a name such as 'train'")
        if not PLAIN_NAME.fullmatch(self.job_name):
            raise _bad(f"cluster.job_name={self.job_name!r}: use letters, digits and . _ , + - only")
        for section in ("env", "nccl_env", "secret_env"):
            for key in getattr(self, section):
                if not ENV_NAME.fullmatch(key):
                    raise _bad(f"cluster.{section}.{key}: not a valid environment variable name")
        for key in list(self.env) + list(self.nccl_env):
            if SECRET_LIKE.search(key.upper()):
                raise _bad(
                    f"cluster.env.{key} looks like a credential; never write it into the job: set "
                    f"cluster.secret_env.{key} to a reference instead"
                )
        stages = [Stage.data_preparation.value, Stage.training.value, Stage.fine_tuning.value]
        for stage in self.stages:
            if stage not in stages:
                raise _bad(
                    f"cluster.stages: {stage!r} is not a stage the launcher runs; choose from {', '.join(stages)}"
                )
        if self.local_ranks_filter and not re.fullmatch(r"\d+(,\d+)*", self.local_ranks_filter):
            raise _bad(f"cluster.local_ranks_filter={self.local_ranks_filter!r}: give local ranks such as 0 or 0,1")


@dataclass
class LocalCluster(ClusterBase):
    """This machine: torchrun directly, in a container, or as `nodes` agents on 127.0.0.1."""


@dataclass
class SlurmCluster(ClusterBase):
    type: Backend = Backend.slurm
    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = "04:00:00"  # HH:MM:SS, D-HH:MM:SS or minutes
    exclusive: Optional[bool] = None  # whole nodes; null: yes for a GPU job, no for a CPU job
    requeue: bool = True  # on the warning or pre-emption: save, requeue the same job id, resume
    chain: int = 0  # extra copies chained with --dependency=afterany,singleton past one time limit
    # Escape hatches, written as given: each sbatch_extra entry becomes `#SBATCH <entry>`, srun_extra
    # entries go on the srun line (one argument each, quoted), setup lines run before srun (`module load`).
    sbatch_extra: List[str] = field(default_factory=list)
    srun_extra: List[str] = field(default_factory=list)
    setup: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chain < 0:
            raise _bad(f"cluster.chain={self.chain}: must be >= 0")
        for name in ("partition", "account", "qos"):
            value = getattr(self, name)
            if value and not PLAIN_NAME.fullmatch(value):
                raise _bad(f"cluster.{name}={value!r}: use letters, digits and . _ , + - only")
        if not SLURM_TIME.fullmatch(self.time_limit):
            raise _bad(f"cluster.time_limit={self.time_limit!r}: use HH:MM:SS, D-HH:MM:SS or minutes")
        if self.mem and not SLURM_MEM.fullmatch(self.mem):
            raise _bad(f"cluster.mem={self.mem!r}: Slurm memory such as 0 (all), 500G or 64000M")
        for entry in self.sbatch_extra:
            if not re.fullmatch(r"--?[A-Za-z][-A-Za-z0-9_]*(=[^\s'\"\\$`]+)?", entry):
                raise _bad(
                    f"cluster.sbatch_extra: {entry!r}: give one sbatch option per entry, such as "
                    "--constraint=h100 (no spaces or quotes: #SBATCH lines are not parsed by a shell)"
                )
        for line in self.setup:
            if "\n" in line:
                raise _bad("cluster.setup: one command per entry, without newlines")


@dataclass
class K8sCluster(ClusterBase):
    type: Backend = Backend.k8s
    namespace: str = "default"
    image_pull_secrets: List[str] = field(default_factory=list)  # secret names only
    image_pull_policy: str = "IfNotPresent"  # Always | IfNotPresent | Never
    # Shared memory (/dev/shm, a memory-backed emptyDir that counts against the pod's memory
    # limit); empty: derived, see [Note: pod sizes] in launcher_scripts/k8s.py.
    shm_size: str = ""
    data_volume: str = ""  # PVC mounted at /data
    # PVC mounted at /checkpoints; the run directory lives there. ReadWriteMany: every pod writes its
    # shards and reads the others' (required with nodes > 1).
    checkpoint_volume: str = ""
    node_selector: Dict[str, str] = field(default_factory=dict)
    tolerations: List[Dict[str, Any]] = field(default_factory=list)  # written as given (v1 Toleration)
    affinity: Dict[str, Any] = field(default_factory=dict)  # written as given (v1 Affinity)
    priority_class: str = ""
    service_account: str = ""
    annotations: Dict[str, str] = field(default_factory=dict)  # on the PyTorchJob and every pod
    # Labels on the PyTorchJob and every pod, e.g. {kueue.x-k8s.io/queue-name: team-a} for Kueue
    labels: Dict[str, str] = field(default_factory=dict)
    # The pods use the node's network (RDMA set up on the host, some EFA/RoCE setups); dnsPolicy
    # then defaults to ClusterFirstWithHostNet so the rendezvous service name still resolves.
    host_network: bool = False
    dns_policy: str = ""  # ClusterFirst | ClusterFirstWithHostNet | Default | None; empty: derived
    ttl_seconds_after_finished: int = -1  # delete the finished job after this long (-1: keep)
    backoff_limit: int = 3  # pod restarts before the job fails
    # Gang scheduling: every pod of the job starts together or none does (runPolicy.schedulingPolicy),
    # with a gang scheduler (scheduler_name, e.g. volcano) and its queue.
    gang_scheduling: bool = False
    scheduler_name: str = ""
    queue: str = ""
    # RDMA devices per pod from the device plugin, e.g. {rdma/ib: 1} or {nvidia.com/hostdev: 8};
    # adds the IPC_LOCK capability NCCL needs to pin memory for InfiniBand/RoCE.
    ib_resources: Dict[str, int] = field(default_factory=dict)
    ipc_lock: bool = False  # IPC_LOCK without ib_resources (hostNetwork or SR-IOV set up elsewhere)

    def __post_init__(self) -> None:
        super().__post_init__()
        # <job_name>-YYYYmmdd-HHMMSS[-n] names the PyTorchJob; its pods' Services add -worker-<i>:
        # at most 63 characters, a DNS-1035 label.
        if not DNS1035_LABEL.fullmatch(self.job_name) or len(self.job_name) > 30:
            raise _bad(
                f"cluster.job_name={self.job_name!r}: Kubernetes names start with a lowercase letter, "
                "then lowercase letters, digits and '-', at most 30 characters here (e.g. llama-7b)"
            )
        if not DNS1123_LABEL.fullmatch(self.namespace) or len(self.namespace) > 63:
            raise _bad(
                f"cluster.namespace={self.namespace!r}: a Kubernetes namespace is lowercase letters, "
                "digits and '-', starting and ending with a letter or digit"
            )
        names = [("image_pull_secrets", n) for n in self.image_pull_secrets]
        names += [(k, getattr(self, k)) for k in ("service_account", "priority_class") if getattr(self, k)]
        for key, name in names:
            if not DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
                raise _bad(f"cluster.{key}: {name!r} is not a Kubernetes name (lowercase letters, digits, '-' and '.')")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise _bad(f"cluster.image_pull_policy={self.image_pull_policy!r}: choose Always, IfNotPresent or Never")
        if self.dns_policy and self.dns_policy not in ("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"):
            raise _bad(
                f"cluster.dns_policy={self.dns_policy!r}: choose ClusterFirst, ClusterFirstWithHostNet, Default or None"
            )
        for key, value in sorted(self.labels.items()):
            name = key.rsplit("/", 1)[-1]
            if not LABEL_NAME.fullmatch(name) or len(name) > 63 or not LABEL_VALUE.fullmatch(str(value)):  # noqa: PLR2004
                raise _bad(
                    f"cluster.labels.{key}={value!r}: a Kubernetes label is a name (letters, digits, '-', '_', "
                    "'.', at most 63, optionally prefix/) and a value of at most 63 such characters"
                )
        for key in (("shm_size",) if self.shm_size else ()) + (("mem",) if self.mem else ()):
            if not K8S_QUANTITY.fullmatch(getattr(self, key)):
                raise _bad(f"cluster.{key}={getattr(self, key)!r}: a Kubernetes quantity such as 64Gi")
        for key, ref in sorted(self.secret_env.items()):
            secret, _, secret_key = ref.partition("/")
            if not DNS1123_SUBDOMAIN.fullmatch(secret) or (secret_key and not SECRET_KEY.fullmatch(secret_key)):
                raise _bad(
                    f"cluster.secret_env.{key}={ref!r}: with cluster=k8s give a Secret as "
                    "'secret-name/key' (or 'secret-name' for the key named like the variable)"
                )
        for name, count in self.ib_resources.items():
            if count <= 0 or "/" not in name:
                raise _bad(
                    f"cluster.ib_resources.{name}={count}: give a device-plugin resource such as "
                    "rdma/ib and a count > 0"
                )
        if self.gang_scheduling and not self.scheduler_name:
            raise _bad("cluster.gang_scheduling=true needs cluster.scheduler_name (the gang scheduler, e.g. volcano)")


BACKENDS = {schema.type: schema for schema in (LocalCluster, SlurmCluster, K8sCluster)}  # typed settings per backend


@dataclass
class LauncherConfig:
    cluster: Any = MISSING  # one of the backends, ClusterBase subclasses (conf/cluster/<backend>.yaml)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    dry_run: bool = False  # write the job files, submit nothing


def register() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="launcher_schema", node=LauncherConfig)
    for backend, schema in BACKENDS.items():
        store.store(group="cluster", name=f"{backend.value}_schema", node=schema)


# The training schema's cluster fields: the job's shape, which main.py needs too.
TRAINING_CLUSTER_FIELDS = frozenset(f.name for f in dataclasses.fields(ClusterConfig))


def override_key(override: str) -> str:
    return override.lstrip("~+").split("=", 1)[0].strip()


def is_launcher_key(key: str) -> bool:
    """Whether an override is the launcher's alone (main.py never gets it)."""
    top, _, rest = key.partition(".")
    if top == "cluster" and rest:
        return rest.split(".")[0] not in TRAINING_CLUSTER_FIELDS
    return top in ("container", "dry_run")


def split_overrides(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(training overrides, launcher overrides); `cluster=<backend>` goes to both."""
    training, launcher = [], []
    for override in argv:
        key = override_key(override)
        if key == "cluster":
            training.append(override)
            launcher.append(override)
        elif is_launcher_key(key):
            launcher.append(override)
        else:
            training.append(override)
    return training, launcher


def compose_launcher(backend: str, overrides: Sequence[str]) -> DictConfig:
    """Compose `launcher_scripts/conf/launcher.yaml` for `backend` with the launcher's overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    # `cluster.node_selector={a: b}` replaces a whole mapping; Hydra only adds keys to an empty typed
    # mapping with `++` (the values are still checked against the schema).
    mappings = {
        f"cluster.{f.name}" for f in dataclasses.fields(BACKENDS[Backend(backend)]) if f.type.startswith("Dict")
    }
    rest = [
        f"++{o}" if override_key(o) in mappings and o[0] not in "+~" else o
        for o in overrides
        if override_key(o) != "cluster"
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="launcher", overrides=[f"cluster={backend}", *rest])


def to_launcher_config(composed: DictConfig) -> LauncherConfig:
    """The launcher's settings as objects; a key the schema lacks (`+cluster.partiton=batch`) is
    refused naming the nearest real one (framework/config/compose.check_known_keys)."""
    from framework.config.compose import check_known_keys

    check_known_keys(composed, LauncherConfig)
    cluster = composed.get("cluster")
    backend = cluster.get("type") if cluster is not None else None
    if backend is not None:
        check_known_keys(cluster, BACKENDS[Backend(getattr(backend, "value", backend))], "cluster.")
    return OmegaConf.to_object(composed)  # type: ignore[return-value]


def field_hint(key: str, backend: str) -> Optional[str]:
    """For `cluster.<field>` that the chosen backend lacks: which backends have it."""
    top, _, rest = key.partition(".")
    name = rest.split(".")[0]
    if top != "cluster" or not name:
        return None
    owners = [b.value for b, schema in BACKENDS.items() if name in {f.name for f in dataclasses.fields(schema)}]
    if backend in owners or name in TRAINING_CLUSTER_FIELDS:
        return None
    if not owners:
        return (
            f"{key}: no such setting of cluster={backend}; its settings are the fields of "
            f"{BACKENDS[Backend(backend)].__name__} in launcher_scripts/config.py"
        )
    return f"{key} is a setting of cluster={' or cluster='.join(owners)}; it does not apply to cluster={backend}"
