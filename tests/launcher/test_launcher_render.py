"""The pure renderers: golden files, shellcheck, Kubernetes schemas, secrets, derived meshes.

Regenerate the goldens after an intended change with
    LAUNCHER_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/launcher -k golden
and review the diff like code.
"""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
import yaml
from launcher_testlib import (
    CASES,
    GOLDEN,
    JOB_DIR,
    PYTHON,
    REPO_DIR,
    TINY,
    pinned_tool,
    plan_of,
    render_case,
    render_case_fresh,
)

from launcher_scripts import k8s
from launcher_scripts.plan import Refused, make_job


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    files = render_case(case)
    folder = GOLDEN / case
    if os.environ.get("LAUNCHER_UPDATE_GOLDEN") == "1":
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for name, text in files.items():
            (folder / name).write_text(text)
    expected = sorted(p.name for p in folder.iterdir())
    assert sorted(files) == expected, f"{case}: files differ from {folder}"
    for name, text in files.items():
        golden = (folder / name).read_text()
        assert text == golden, (
            f"{case}/{name} differs from its golden file; if the change is intended, "
            "regenerate with LAUNCHER_UPDATE_GOLDEN=1 and review the diff"
        )
    # Rendering twice gives the same bytes (no clock, no environment).
    assert render_case_fresh(case) == files


def test_goldens_hold_no_machine_paths():
    here = str(GOLDEN.parents[2])
    for path in GOLDEN.rglob("*"):
        if path.is_file():
            assert here not in path.read_text(), f"{path} holds this machine's path {here}"


def test_every_generated_script_passes_shellcheck(tmp_path):
    scripts = []
    for case in CASES:
        for name, text in render_case(case).items():
            if name.endswith((".sh", ".sbatch")):
                path = tmp_path / f"{case}--{name}"
                path.write_text(text)
                scripts.append(str(path))
    out = subprocess.run(
        [pinned_tool("shellcheck"), "--shell=bash", "--severity=style", *scripts], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _pod_docs(case):
    return k8s.pod_documents(yaml.safe_load(render_case(case)["pytorchjob.yaml"]))


def test_pytorchjob_pod_templates_pass_kubernetes_schema():
    import kubernetes_validate

    docs = _pod_docs("k8s")
    assert [d["metadata"]["labels"]["app.kubernetes.io/component"] for d in docs] == ["master", "worker"]
    for doc in docs:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    # The templates exactly as embedded, wrapped as `v1 PodTemplate` documents.
    manifest = yaml.safe_load(render_case("k8s")["pytorchjob.yaml"])
    for role, spec in manifest["spec"]["pytorchReplicaSpecs"].items():
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"train-golden-{role.lower()}"},
                "template": spec["template"],
            },
            "1.37.0",
            strict=True,
        )
    # The validator really checks: a wrong type in the same document is refused.
    broken = docs[0]
    broken["spec"]["containers"][0]["ports"][0]["containerPort"] = "29500"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.37.0", strict=True)


def test_pytorchjob_shape():
    manifest = yaml.safe_load(render_case("k8s")["pytorchjob.yaml"])
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2  # 3 nodes
    spec = replicas["Worker"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "--rdzv-backend=c10d" in container["command"]
    assert "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)" in container["command"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Gi"}} in spec["volumes"]  # 8 ranks x 32Gi
    claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"datasets", "checkpoints"}
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    # Kubernetes would expand $(HOME) in a command: the override is escaped so main.py gets it verbatim.
    assert "checkpoint.dir='$$(HOME)/ckpt; rm -rf ~'" in container["command"]
    # The run directory is on the checkpoint volume, so a restarted pod resumes from it.
    assert "hydra.run.dir=/checkpoints/train-golden/run" in container["command"]
    assert "checkpoint.resume=auto" in container["command"]


def test_secrets_are_references_never_values(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-value")
    monkeypatch.setenv("MY_HF_TOKEN", "hf-secret-value")
    for case in CASES:
        for name, text in render_case(case).items():
            assert "secret-value" not in text, f"{case}/{name} holds a secret's value"
    env = _pod_docs("k8s")[0]["spec"]["containers"][0]["env"]
    reference = {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}
    assert {"name": "HF_TOKEN", "valueFrom": reference} in env
    assert all("value" not in e for e in env if e["name"] == "HF_TOKEN")
    sbatch = render_case("slurm_apptainer")["training.sbatch"]
    assert 'export HF_TOKEN="${MY_HF_TOKEN:?' in sbatch
    docker = render_case("local_docker")["submit.sh"]
    assert "--env HF_TOKEN " in docker  # the name only: docker copies the value from the environment


def test_secret_looking_env_is_refused():
    with pytest.raises(Refused) as refused:
        plan_of(["cluster=slurm", "+cluster.env.HF_TOKEN=abc"])
    assert "cluster.secret_env.HF_TOKEN" in refused.value.problems[0]


def test_derive_mesh_from_cluster_shape():
    p = plan_of(CASES["slurm_pyxis"])
    par = p.cfg.parallelism
    assert (par.dp_replicate, par.dp_shard, par.tp, par.strategy.value) == (4, 4, 2, "hybrid")
    assert p.overrides[-3:] == ["parallelism.dp_replicate=4", "parallelism.dp_shard=4", "parallelism.strategy=hybrid"]
    # trainer.max_time_minutes from cluster.time_limit=04:00:00 less half the 120 s warning.
    assert p.training_only == ["checkpoint.resume=auto", "trainer.max_time_minutes=239.0"]
    with pytest.raises(Refused) as refused:
        plan_of(["cluster=slurm", "cluster.derive_mesh=true", "parallelism.dp_shard=2"])
    assert "parallelism.dp_shard" in refused.value.problems[0]


def test_overrides_pass_through_unchanged():
    argv = [
        "cluster=local",
        "model=debug",
        "data=synthetic",
        "dry_run=true",
        "hydra.run.dir=/elsewhere",
        "trainer.max_steps=4",
        "checkpoint.dir='a b'",
    ]
    p = plan_of(argv)
    assert p.overrides == [
        "cluster=local",
        "model=debug",
        "data=synthetic",
        "trainer.max_steps=4",
        "checkpoint.dir='a b'",
    ]
    assert p.training_only == ["checkpoint.resume=auto"]
    job = make_job(p, JOB_DIR, "/opt/repo", "/opt/venv/bin/python")
    from launcher_scripts.local import render_local_commands

    (argv_,) = render_local_commands(p.cfg, job)
    assert argv_[-7:] == [*p.overrides, "checkpoint.resume=auto", f"hydra.run.dir={JOB_DIR}/run"]
    # An explicit choice is kept.
    explicit = plan_of([*argv, "checkpoint.resume=none"])
    assert explicit.overrides[-1] == "checkpoint.resume=none" and explicit.training_only == []


def test_stages_chain_with_dependencies():
    files = render_case("slurm_apptainer")
    submit = files["submit.sh"]
    assert submit.index("data_preparation.sbatch") < submit.index("training.sbatch")
    assert '--dependency="afterok:${id},singleton"' in submit
    prep = files["data_preparation.sbatch"]
    assert "stage=data_preparation" in prep and "--ntasks=1" in prep and "torch.distributed.run" not in prep
    assert "stage=training" in files["training.sbatch"]
    assert "checkpoint.resume=auto" in files["training.sbatch"] and "checkpoint.resume" not in prep
    chained = render_case("slurm_pyxis")["submit.sh"]
    assert chained.count('--dependency="afterany:${id},singleton"') == 2  # cluster.chain=2
    assert "--signal=B:USR1@120" in render_case("slurm_pyxis")["training.sbatch"]


@pytest.mark.parametrize(
    "limit, seconds",
    [("5", 300), ("1:30", 90), ("04:00:00", 14400), ("1-0", 86400), ("1-02:03", 93780), ("2-00:00:10", 172810)],
)
def test_slurm_time_formats(limit, seconds):
    from launcher_scripts.plan import slurm_seconds

    assert slurm_seconds(limit) == seconds


def test_slurm_cpu_advice(caplog):
    with caplog.at_level("WARNING", logger="launcher"):
        plan_of(
            ["cluster=slurm", "model=debug", "data=synthetic", "cluster.gpus_per_node=0", "cluster.nproc_per_node=2"]
        )
    assert any("cluster.cpus_per_task" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="launcher"):
        plan_of(
            [
                "cluster=slurm",
                "model=debug",
                "data=synthetic",
                "cluster.gpus_per_node=0",
                "cluster.nproc_per_node=2",
                "cluster.cpus_per_task=2",
            ]
        )
    assert not [r for r in caplog.records if r.name == "launcher"]


def test_an_image_without_a_runtime_runs_with_the_clusters_usual_one():
    image = ["model=debug", "data=synthetic", "container.image=registry.example/org/train:1.0"]
    p = plan_of(["cluster=slurm", "cluster.gpus_per_node=0", "cluster.nproc_per_node=2", *image])
    assert p.launch.container.runtime.value == "pyxis" and not any("container" in o for o in p.overrides)
    assert plan_of(["cluster=local", *image]).launch.container.runtime.value == "docker"
    # An explicit choice is kept.
    assert plan_of(["cluster=local", "container.runtime=none", *image]).launch.container.runtime.value == "none"


def _readme_commands():
    root = GOLDEN.parents[2]
    text = "\n".join((root / name).read_text() for name in ("README.md", "docs/launcher.md")).replace("\\\n", " ")
    prefix = ".venv/bin/python launcher_scripts/main.py "
    commands = [
        shlex.split(line.strip()[len(prefix) :]) for line in text.splitlines() if line.strip().startswith(prefix)
    ]
    return [c for c in commands if c and c[0] not in ("status", "logs", "cancel")]  # those take a job dir


def test_every_launcher_command_in_the_docs_is_accepted():
    commands = _readme_commands()
    assert len(commands) >= 6
    for argv in commands:
        try:
            plan_of(argv)
        except Refused as refused:
            raise AssertionError(f"documented command {argv} is refused: {refused.problems}") from None


def test_the_training_job_never_sees_the_launchers_settings():
    """The launcher has its own typed config per backend; main.py gets training overrides only."""
    import dataclasses

    from framework.config import ClusterConfig, Config

    argv = [
        "cluster=slurm",
        "cluster.nodes=2",
        "cluster.partition=batch",
        "cluster.time_limit=1:00:00",
        "container=pyxis",
        "container.image=x:1",
        "dry_run=true",
        "+cluster.env.A=b",
        "model=debug",
        "data=synthetic",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=2",
        "trainer.global_batch_size=32",
    ]
    p = plan_of(argv)
    assert p.overrides == [
        "cluster=slurm",
        "cluster.nodes=2",
        "model=debug",
        "data=synthetic",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=2",
        "trainer.global_batch_size=32",
    ]
    assert (p.launch.cluster.partition, p.launch.container.image, p.launch.dry_run) == ("batch", "x:1", True)
    assert (p.cfg.cluster.nodes, p.cfg.cluster.nproc_per_node) == (2, 2)  # the shape, read from training
    # The training schema holds the job's shape and nothing about Slurm, Kubernetes or containers.
    assert {f.name for f in dataclasses.fields(ClusterConfig)} == {
        "nodes",
        "nproc_per_node",
        "gpus_per_node",
        "gpu_type",
        "gpu_memory_gib",
    }
    assert not {"container", "dry_run"} & {f.name for f in dataclasses.fields(Config)}
    assert set(p.resolved.cluster.keys()) == {f.name for f in dataclasses.fields(ClusterConfig)}


def test_fine_tuning_stage_starts_from_the_training_stages_export(tmp_path):
    from launcher_scripts.plan import make_job, render_job

    argv = [
        "cluster=slurm",
        "cluster.nodes=1",
        "cluster.nproc_per_node=2",
        "cluster.gpus_per_node=0",
        "cluster.cpus_per_task=2",
        "cluster.stages=[training,fine_tuning]",
        "finetune.train_file=/shared/data/sft.jsonl",
        *TINY,
    ]
    p = plan_of(argv)
    files = render_job(p, make_job(p, JOB_DIR, REPO_DIR, PYTHON), JOB_DIR)
    train, tune, submit = files["training.sbatch"], files["fine_tuning.sbatch"], files["submit.sh"]
    assert "stage=training" in train and "checkpoint.export_safetensors=true" in train
    assert f"hydra.run.dir={JOB_DIR}/run" in train
    # Fine-tuning writes its own run directory (it must not resume training's checkpoints) and
    # starts from the training stage's export.
    assert "stage=fine_tuning" in tune and f"hydra.run.dir={JOB_DIR}/fine_tuning" in tune
    assert f"checkpoint.init_from={JOB_DIR}/run/checkpoints/export" in tune
    assert "checkpoint.resume=auto" in tune  # a requeued fine-tuning continues where it stopped
    assert submit.index("training.sbatch") < submit.index("fine_tuning.sbatch")
    assert submit.count('--dependency="afterok:${id},singleton"') == 1
    # A starting point the user chose is kept.
    mine = plan_of([*argv, f"checkpoint.init_from={tmp_path}"])
    tune = render_job(mine, make_job(mine, JOB_DIR, REPO_DIR, PYTHON), JOB_DIR)["fine_tuning.sbatch"]
    assert f"checkpoint.init_from={tmp_path}" in tune and "/run/checkpoints/export" not in tune


def test_every_backend_is_one_object_with_its_settings():
    """`cluster=<backend>` choices, their typed settings and the backend objects agree, and a
    backend's behaviour is its object's (no name comparisons elsewhere in the launcher)."""
    import re
    from pathlib import Path

    from launcher_scripts.backends import BACKEND_OBJECTS, backend_of
    from launcher_scripts.config import BACKENDS, Backend

    assert set(BACKEND_OBJECTS) == set(BACKENDS) == set(Backend)
    for backend in Backend:
        assert backend_of(backend.value) is BACKEND_OBJECTS[backend] and BACKENDS[backend].type == backend
    here = Path(__file__).resolve().parents[2] / "launcher_scripts"
    for path in here.glob("*.py"):
        if path.name != "backends.py":
            text = path.read_text()
            assert not re.search(r"==\s*Backend\.|Backend\.\w+\s*:|== \"(slurm|k8s|local)\"", text), path.name


def test_pyxis_image_references_take_enroots_registry_form():
    """enroot/pyxis name a registry with '#': `nvcr.io/org/train:1.0` becomes `nvcr.io#org/train:1.0`
    (some enroot versions look the slash form up on Docker Hub); both forms are accepted as input."""
    from launcher_scripts.slurm import pyxis_image

    assert pyxis_image("nvcr.io/org/train:1.0") == "nvcr.io#org/train:1.0"
    assert pyxis_image("nvcr.io#org/train:1.0") == "nvcr.io#org/train:1.0"
    assert pyxis_image("registry:5000/train:1.0") == "registry:5000#train:1.0"
    assert pyxis_image("localhost/train") == "localhost#train"
    assert (
        pyxis_image("pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime") == "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
    )
    assert pyxis_image("ubuntu:24.04") == "ubuntu:24.04"
    assert pyxis_image("/lustre/images/train.sqsh") == "/lustre/images/train.sqsh"
    assert "--container-image=registry.example#org/train:1.0" in render_case("slurm_pyxis")["training.sbatch"]


def test_k8s_single_pod_without_a_checkpoint_volume_is_warned(caplog):
    """One pod keeps its run directory in the container layer: a restarted pod would start over
    with resume=auto. Warned, naming the fix; not warned with a volume or without checkpoints."""
    one_pod = [
        "cluster=k8s",
        "model=debug",
        "data=synthetic",
        "container.image=registry.example/org/train:1.0",
        "trainer.global_batch_size=64",
    ]
    for extra, warned in (
        ([], True),
        (["cluster.checkpoint_volume=ckpt"], False),
        (["checkpoint.save_final=false", "checkpoint.interval=0"], False),
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="launcher"):
            plan_of(one_pod + extra)
        said = [r.message for r in caplog.records if "cluster.checkpoint_volume" in r.message]
        assert bool(said) == warned, (extra, said)
