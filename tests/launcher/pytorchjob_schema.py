"""The Kubeflow PyTorchJob (kubeflow.org/v1) fields the launcher writes, as a JSON schema.

Written from the training operator's v1 API (PyTorchJobSpec, RunPolicy, SchedulingPolicy,
ReplicaSpec): types and enums as the CRD declares them, and `additionalProperties: false` at every
level we write, so a misspelt or misplaced field fails. The pod templates inside are checked
separately against Kubernetes' own schemas (kubernetes-validate, `v1 PodTemplate`).
"""

from __future__ import annotations

INT = {"type": "integer"}
STRING = {"type": "string"}

REPLICA_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["template"],
    "properties": {
        "replicas": INT,
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}

PYTORCHJOB = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                # DNS-1035 label: the job's name prefixes its pods' Services.
                "name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "namespace": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": STRING},
                "annotations": {"type": "object", "additionalProperties": STRING},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "nprocPerNode": STRING,  # a string in the v1 API ("8", "auto")
                "elasticPolicy": {"type": "object"},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["None", "Running", "All"]},
                        "backoffLimit": INT,
                        "ttlSecondsAfterFinished": INT,
                        "activeDeadlineSeconds": INT,
                        "suspend": {"type": "boolean"},
                        "schedulingPolicy": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "minAvailable": INT,
                                "queue": STRING,
                                "priorityClass": STRING,
                                "minResources": {"type": "object"},
                                "scheduleTimeoutSeconds": INT,
                            },
                        },
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "required": ["Master"],
                    "propertyNames": {"enum": ["Master", "Worker"]},
                    "additionalProperties": REPLICA_SPEC,
                },
            },
        },
    },
}
