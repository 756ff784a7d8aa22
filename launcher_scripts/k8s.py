"""Kubernetes: a Kubeflow PyTorchJob (one Master pod, nodes - 1 Worker pods), applied with kubectl.

Every pod runs one torchrun agent with cluster.nproc_per_node ranks; they meet by c10d rendezvous
at the Master's service, which the training operator names in MASTER_ADDR / MASTER_PORT (the port
is the container port called `pytorchjob-port`). Kubernetes expands `$(VAR)` in a container's
command, args and env values, and `$$` is its escape: every `$` of a user's value is written `$$`
so it reaches main.py unchanged. The run directory lives on the checkpoint volume (ReadWriteMany:
every pod writes its shards and reads the others'), so a restarted pod resumes from the latest
checkpoint. restartPolicy ExitCode: refused input (2) and a diverged run (3) fail the job at once,
a pre-emption (75) or a crash restarts it (see [Note: exit codes in a pod] in pod_entry.py).
On deletion or eviction the pods get SIGTERM and
terminationGracePeriodSeconds (cluster.signal_seconds) to save; torchrun's --shutdown-timeout
matches it.
"""

from __future__ import annotations

from typing import Any, Dict, List

from framework.config import Config
from launcher_scripts.config import K8sCluster
from launcher_scripts.job import Job, join_lines, main_args, script_header, shell_line, stages_of, torchrun_args

API_VERSION = "kubeflow.org/v1"
DATA_MOUNT = "/data"
CHECKPOINT_MOUNT = "/checkpoints"
PORT_NAME = "pytorchjob-port"  # the operator reads MASTER_PORT from the port with this name
DEFAULT_PORT = 29500  # each pod has its own network namespace: a fixed port cannot collide
IMAGE_UID = 1000  # the Dockerfile's user


def _cluster(job: Job) -> K8sCluster:
    assert isinstance(job.cluster, K8sCluster), type(job.cluster)
    return job.cluster


def k8s_job_dir(c: K8sCluster, workdir: str, name: str) -> str:
    """Where a job's run directory is inside its pods: on the checkpoint volume when there is one."""
    if c.checkpoint_volume:
        return f"{CHECKPOINT_MOUNT}/{name}"
    return f"{workdir}/jobs/{name}"


def escape(value: str) -> str:
    """Kubernetes' escape for `$(VAR)` expansion: `$$` is a literal `$`."""
    return value.replace("$", "$$")


def _env(job: Job) -> List[Dict[str, Any]]:
    c = job.cluster
    env: List[Dict[str, Any]] = [
        {"name": k, "value": escape(str(v))} for k, v in sorted(c.nccl_env.items()) + sorted(c.env.items())
    ]
    for key, ref in sorted(c.secret_env.items()):
        secret, _, secret_key = ref.partition("/")
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": secret_key or key}}})
    return env


# [Note: pod sizes]
# Requests equal limits (Guaranteed QoS). A memory-backed /dev/shm (emptyDir, medium Memory) is
# charged to the pod's memory limit, so the limit is the processes' memory *plus* the shm size;
# counting shm inside a process budget would leave the ranks less than planned. Defaults, per rank
# (one rank per GPU on a GPU pod):
#   GPU pod:  10 CPUs, 96Gi for the processes, 32Gi of /dev/shm (NCCL's intra-node buffers and
#             loader workers). 8 GPUs: cpu 80, shm 256Gi, memory 8 x 96Gi + 256Gi = 1024Gi, which
#             fits the 2 TiB, 112-224 CPU nodes 8-GPU servers come as, with room for the system.
#   CPU pod:  2 CPUs (a loader thread beside each rank), 8Gi, and 2Gi of shm per rank (at least 4Gi).
# cluster.cpus_per_task, cluster.mem and cluster.shm_size override each (mem is then the whole limit).
GPU_CPUS, GPU_MEM_GI, GPU_SHM_GI = 10, 96, 32
CPU_CPUS, CPU_MEM_GI, CPU_SHM_GI = 2, 8, 2


def pod_sizes(cfg: Config, c: K8sCluster) -> Dict[str, Any]:
    """{cpu, memory, shm} of one pod (see [Note: pod sizes])."""
    ranks, gpus = cfg.cluster.nproc_per_node, cfg.cluster.gpus_per_node
    per_cpu, per_mem, per_shm = (GPU_CPUS, GPU_MEM_GI, GPU_SHM_GI) if gpus else (CPU_CPUS, CPU_MEM_GI, CPU_SHM_GI)
    shm_gi = per_shm * ranks if gpus else max(4, per_shm * ranks)
    return {
        "cpu": c.cpus_per_task or per_cpu * ranks,
        "memory": c.mem or f"{per_mem * ranks + (0 if c.shm_size else shm_gi)}Gi",
        "shm": c.shm_size or f"{shm_gi}Gi",
    }


def _resources(cfg: Config, c: K8sCluster) -> Dict[str, Any]:
    """Requests equal to limits (Guaranteed QoS, never BestEffort): GPUs, CPUs, memory, RDMA devices."""
    amounts: Dict[str, Any] = {}
    if cfg.cluster.gpus_per_node:
        amounts["nvidia.com/gpu"] = cfg.cluster.gpus_per_node
    sizes = pod_sizes(cfg, c)
    amounts["cpu"], amounts["memory"] = sizes["cpu"], sizes["memory"]
    amounts.update(c.ib_resources)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _pod_template(cfg: Config, job: Job, role: str) -> Dict[str, Any]:
    c, k = _cluster(job), job.container
    port = c.rdzv_port or DEFAULT_PORT
    # The pod's status says what the operator's ExitCode policy needs (see [Note: exit codes in a pod]).
    command = [job.python, "-m", "launcher_scripts.pod_entry"]
    command += torchrun_args(cfg, job, "$(MASTER_ADDR):$(MASTER_PORT)", job.name)
    command += [escape(a) for a in main_args(job, stages_of(job, cfg)[0])]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    shm = pod_sizes(cfg, c)["shm"]
    volumes: List[Dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    for name, claim, path in (
        ("data", c.data_volume, DATA_MOUNT),
        ("checkpoints", c.checkpoint_volume, CHECKPOINT_MOUNT),
    ):
        if claim:
            mounts.append({"name": name, "mountPath": path})
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim}})
    container: Dict[str, Any] = {
        "name": "pytorch",  # the training operator looks for this name
        "image": k.image,
        "imagePullPolicy": c.image_pull_policy,
        "command": command,
        "workingDir": k.workdir,
        "ports": [{"name": PORT_NAME, "containerPort": port}],
        "resources": _resources(cfg, c),
        "volumeMounts": mounts,
    }
    env = _env(job)
    if env:
        container["env"] = env
    if c.ib_resources or c.ipc_lock:
        # NCCL pins memory for InfiniBand/RoCE (ibv_reg_mr): the pod needs IPC_LOCK.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    # fsGroup: the volumes are writable by the image's user; OnRootMismatch: a large checkpoint
    # volume is not re-chowned file by file on every pod start.
    spec: Dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": c.signal_seconds,
        "securityContext": {"fsGroup": IMAGE_UID, "fsGroupChangePolicy": "OnRootMismatch"},
    }
    if c.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in c.image_pull_secrets]
    if c.node_selector:
        spec["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        spec["tolerations"] = [dict(t) for t in c.tolerations]
    if c.affinity:
        spec["affinity"] = dict(c.affinity)
    if c.priority_class:
        spec["priorityClassName"] = c.priority_class
    if c.service_account:
        spec["serviceAccountName"] = c.service_account
    if c.scheduler_name:
        spec["schedulerName"] = c.scheduler_name
    if c.host_network:
        spec["hostNetwork"] = True
    if c.dns_policy or c.host_network:
        spec["dnsPolicy"] = c.dns_policy or "ClusterFirstWithHostNet"
    labels = {
        **c.labels,
        "app.kubernetes.io/name": c.job_name,
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": role.lower(),
    }
    metadata: Dict[str, Any] = {"labels": labels}
    if c.annotations:
        metadata["annotations"] = dict(c.annotations)
    return {"metadata": metadata, "spec": spec}


def render_pytorchjob(cfg: Config, job: Job) -> Dict[str, Any]:
    """The PyTorchJob manifest as a dict (pure: same inputs, same dict)."""
    c = _cluster(job)
    replicas: Dict[str, Any] = {
        "Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": _pod_template(cfg, job, "Master")},
    }
    if cfg.cluster.nodes > 1:
        replicas["Worker"] = {
            "replicas": cfg.cluster.nodes - 1,
            "restartPolicy": "ExitCode",
            "template": _pod_template(cfg, job, "Worker"),
        }
    run_policy: Dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": c.backoff_limit}
    if c.ttl_seconds_after_finished >= 0:
        run_policy["ttlSecondsAfterFinished"] = c.ttl_seconds_after_finished
    if c.gang_scheduling:
        policy: Dict[str, Any] = {"minAvailable": cfg.cluster.nodes}
        if c.queue:
            policy["queue"] = c.queue
        if c.priority_class:
            policy["priorityClass"] = c.priority_class
        run_policy["schedulingPolicy"] = policy
    metadata: Dict[str, Any] = {
        "name": job.name,
        "namespace": c.namespace,
        "labels": {
            **c.labels,
            "app.kubernetes.io/name": c.job_name,
            "app.kubernetes.io/managed-by": "launcher_scripts",
        },
    }
    if c.annotations:
        metadata["annotations"] = dict(c.annotations)
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": metadata,
        "spec": {
            "runPolicy": run_policy,
            "nprocPerNode": str(cfg.cluster.nproc_per_node),
            "pytorchReplicaSpecs": replicas,
        },
    }


_POD_POLICY = {"Always": "Always", "OnFailure": "OnFailure", "Never": "Never"}


def pod_documents(manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each replica's pod template as a `v1 Pod` document, for schema validation."""
    docs = []
    for role, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        template = spec["template"]
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{manifest['metadata']['name']}-{role.lower()}-0", **template["metadata"]},
                # With ExitCode the operator restarts pods itself; their own policy is Never.
                "spec": {**template["spec"], "restartPolicy": _POD_POLICY.get(spec["restartPolicy"], "Never")},
            }
        )
    return docs


def render_submit(manifest_path: str) -> str:
    lines = script_header("Applies this job's PyTorchJob manifest to the current kubectl context.")
    lines += ["set -euo pipefail", shell_line(["kubectl", "apply", "-f", manifest_path])]
    return join_lines(lines)
