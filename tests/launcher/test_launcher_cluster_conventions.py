"""What a cluster operator would hit in the first week, each fixed and pinned by the rendered line.

One test per defect (the line that was wrong, now right), the refusals that replace a job that
would fail on the cluster, and what operators expect (escape hatches, Kubernetes scheduling fields
validated against the schemas, the time limit, mounts, the job's lifecycle). All renders are pure:
no cluster, no clock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from launcher_testlib import CASES, JOB_DIR, RECORDER, TINY, plan_of, render_case, run_launcher, write_exe
from pytorchjob_schema import PYTORCHJOB

from launcher_scripts import lifecycle
from launcher_scripts.job import derived_port
from launcher_scripts.plan import Refused, make_job, render_job

SMALL = ["model=debug", "data=synthetic", "cluster.nproc_per_node=2", "cluster.gpus_per_node=0"]


def _refusal(args):
    with pytest.raises(Refused) as refused:
        plan_of([*args, *SMALL])
    problems = refused.value.problems
    assert all("\n" not in p for p in problems), problems
    return " | ".join(problems)


def _manifest(case="k8s"):
    return yaml.safe_load(render_case(case)["pytorchjob.yaml"])


def _k8s_expand(value: str, env: dict) -> str:
    """Kubernetes' expansion of a command argument or env value: $(VAR) -> value, $$ -> $."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


# --- 1. the pre-emption save is not cut short -------------------------------------------------


def test_shutdown_timeout_follows_the_signal_lead_time():
    # Was: torchrun's default 30 s between SIGTERM and SIGKILL, whatever --signal said.
    pyxis = render_case("slurm_pyxis")["training.sbatch"]
    assert "--signal=B:USR1@120" in pyxis and "--shutdown-timeout=100" in pyxis  # 120 s less a 20 s margin
    assert "--shutdown-timeout=280" in render_case("slurm_apptainer")["training.sbatch"]  # signal_seconds=300
    # Pre-emption without the user signal sends TERM to the batch shell: caught, then requeued.
    assert "trap 'on_term' TERM" in pyxis and "trap 'on_warning' USR1" in pyxis
    # Kubernetes: the pods' grace period is the same lead time, and torchrun's matches it.
    pod = _manifest()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert "--shutdown-timeout=100" in pod["containers"][0]["command"]


# --- 2. multi-node Kubernetes needs a shared checkpoint volume -----------------------------------


def test_multi_node_k8s_without_a_shared_volume_is_refused():
    problem = _refusal(["cluster=k8s", "cluster.nodes=2", "container.image=x:1"])
    assert "cluster.checkpoint_volume" in problem and "ReadWriteMany" in problem
    plan_of(["cluster=k8s", "cluster.nodes=1", "container.image=x:1", *SMALL])


# --- 3. paths are checked here only when the job sees this file system ---------------------------


def test_paths_on_the_cluster_are_left_to_the_job():
    # Was: refused because /data/corpus_text_document.idx does not exist on the submitting machine.
    absent = [*SMALL, "data=indexed", "data.seq_len=64", "data.paths=[/data/nowhere/corpus_text_document]"]
    plan_of(["cluster=k8s", "container.image=x:1", "cluster.data_volume=datasets", *absent])
    plan_of(
        ["cluster=slurm", "container=pyxis", "container.image=x:1", "container.mounts=[/lustre/data:/data]", *absent]
    )
    plan_of(
        [
            "cluster=slurm",
            "container=apptainer",
            "container.image=/i.sif",
            *absent,
            "checkpoint.init_from=/lustre/models/none",
        ]
    )
    # Without a container the job reads this machine's (shared) file system: still checked here.
    with pytest.raises(Refused) as refused:
        plan_of(["cluster=slurm", *absent])
    assert "corpus_text_document.idx does not exist" in refused.value.problems[0]


# --- 4. GPU jobs get whole nodes and their memory ------------------------------------------------


def test_gpu_jobs_are_exclusive_with_all_memory():
    gpu = render_case("slurm_pyxis")["training.sbatch"]
    assert "#SBATCH --exclusive\n" in gpu and "#SBATCH --mem=0\n" in gpu
    cpu = render_case("slurm_none")["training.sbatch"]  # a CPU job: neither, unless asked
    assert "--exclusive" not in cpu and "--mem" not in cpu
    chosen = render_case("slurm_apptainer")["training.sbatch"]
    assert "#SBATCH --mem=500G\n" in chosen and "#SBATCH --cpus-per-task=32\n" in chosen
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=32" in chosen


# --- 5. local multi-node GPU jobs give each agent its own GPUs -----------------------------------


def test_local_agents_get_their_own_gpus():
    text = render_case("local_two_node_gpu")["submit.sh"]
    assert "env CUDA_VISIBLE_DEVICES=0,1 \\\n" in text and "env CUDA_VISIBLE_DEVICES=2,3 \\\n" in text


# --- 6. Kubernetes names follow Kubernetes' rules ------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        ("cluster.job_name=7b-llama", "start with a lowercase letter"),  # DNS-1035
        ("cluster.job_name=Train", "cluster.job_name"),
        ("cluster.namespace=ml_team", "cluster.namespace"),  # DNS-1123 label: no '_'
        ("cluster.namespace=ml.team", "cluster.namespace"),
        ("cluster.image_pull_secrets=[reg+cred]", "cluster.image_pull_secrets"),  # DNS-1123 subdomain
        ("cluster.service_account=Trainer", "cluster.service_account"),
    ],
)
def test_kubernetes_names_are_checked_with_kubernetes_rules(override, field):
    assert field in _refusal(["cluster=k8s", "container.image=x:1", override])


def test_valid_kubernetes_names_pass():
    plan_of(
        [
            "cluster=k8s",
            "container.image=x:1",
            "cluster.job_name=llama-7b",
            "cluster.namespace=ml-team",
            "cluster.image_pull_secrets=[reg.cred]",
            *SMALL,
        ]
    )


# --- 7. pods are never BestEffort; a big volume is not re-chowned on every start -----------------


def test_pods_request_cpu_and_memory_and_keep_volume_ownership():
    pod = _manifest()["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS
    assert resources["requests"]["cpu"] == 64 and resources["requests"]["memory"] == "900Gi"
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # Without cluster.cpus_per_task / cluster.mem: still requests (two CPUs and 8 GiB per rank, plus
    # the memory-backed /dev/shm, which counts against the limit: 4 GiB at least).
    p = plan_of(
        [
            "cluster=k8s",
            "container.image=x:1",
            "model=debug",
            "data=synthetic",
            "cluster.nproc_per_node=2",
            "cluster.gpus_per_node=0",
        ]
    )
    manifest = yaml.safe_load(render_job(p, make_job(p, JOB_DIR, "/r", "/p"), JOB_DIR)["pytorchjob.yaml"])
    requests = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"][
        "requests"
    ]
    assert requests == {"cpu": 4, "memory": "20Gi"}
    volumes = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    assert volumes[0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}


def test_an_8_gpu_pod_is_sized_for_an_8_gpu_node_with_shm_counted_in_its_memory():
    pod = yaml.safe_load(render_case("k8s_8gpu")["pytorchjob.yaml"])["spec"]["pytorchReplicaSpecs"]["Worker"]
    spec = pod["template"]["spec"]
    limits = spec["containers"][0]["resources"]["limits"]
    shm = spec["volumes"][0]["emptyDir"]["sizeLimit"]
    # 10 CPUs, 96Gi of process memory and 32Gi of /dev/shm per GPU; the limit holds both.
    assert limits == {"nvidia.com/gpu": 8, "cpu": 80, "memory": "1024Gi"} and shm == "256Gi"
    assert int(limits["memory"][:-2]) == 8 * 96 + int(shm[:-2])


def test_queue_labels_annotations_and_host_network_reach_the_job_and_its_pods():
    import jsonschema
    import kubernetes_validate

    from launcher_scripts import k8s

    manifest = yaml.safe_load(render_case("k8s_8gpu")["pytorchjob.yaml"])
    jsonschema.validate(manifest, PYTORCHJOB)  # ExitCode is one of the operator's policies
    for doc in k8s.pod_documents(manifest):  # as the pods the operator makes (their policy Never)
        kubernetes_validate.validate(doc, "1.37.0", strict=True)
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # what Kueue reads
    assert manifest["metadata"]["annotations"] == {"scheduling.k8s.io/group-name": "llm"}
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        template = replica["template"]
        assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert template["spec"]["hostNetwork"] is True
        assert template["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"  # the Master's service still resolves


@pytest.mark.parametrize(
    "override,field",
    [
        ("cluster.labels={team: 'a b'}", "cluster.labels.team"),
        ("cluster.dns_policy=Sometimes", "cluster.dns_policy"),
    ],
)
def test_bad_kubernetes_labels_and_dns_policy_are_refused(override, field):
    assert field in _refusal(["cluster=k8s", "container.image=x:1", override])


def test_pods_restart_on_a_crash_or_preemption_but_not_on_refused_input():
    from launcher_scripts.pod_entry import pod_status

    manifest = _manifest()
    for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"
        assert replica["template"]["spec"]["containers"][0]["command"][:3] == [
            "python",
            "-m",
            "launcher_scripts.pod_entry",
        ]
    # Kubeflow's ExitCode policy: 1-127 permanent, 128-255 retryable. torchrun exits 1 for any failed rank.
    assert pod_status(0, []) == 0
    assert pod_status(1, [2, 1]) == 2  # a refusal on one rank: the job fails at once
    assert pod_status(1, [3]) == 3  # diverged
    assert pod_status(1, [75, 75]) == 128 + 75  # pre-empted after saving: restarted, resumes
    assert pod_status(1, [1]) == 129 and pod_status(1, []) == 129  # a crash: restarted
    assert pod_status(-9, []) == 128 + 9  # torchrun killed


def test_the_pod_entry_reports_a_rank_refusal_that_torchrun_hides(tmp_path):
    import sys

    from conftest import REPO

    cmd = [sys.executable, "-m", "launcher_scripts.pod_entry", sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc_per_node=2", str(REPO / "main.py"), *TINY, "trainer.collective_timeout_s=inf"]
    out = subprocess.run(
        cmd + [f"hydra.run.dir={tmp_path}/run"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]  # torchrun said 1; the ranks said 2
    assert "pod exit status 2 (torchrun 1, ranks [2])" in out.stderr, out.stderr[-3000:]


# --- 8. no overlapping or double runs -------------------------------------------------------------


def test_slurm_jobs_are_singletons_under_a_unique_name():
    files = render_case("slurm_pyxis")
    assert "#SBATCH --job-name=train-golden\n" in files["training.sbatch"]  # the job directory's name
    submit = files["submit.sh"]
    assert "sbatch --parsable --dependency=singleton " in submit
    assert submit.count('--dependency="afterany:${id},singleton"') == 2  # the chained copies
    assert ': > "$ids"' not in submit and 'echo "$id" >> "$ids"' in submit  # ids kept across submissions


def test_a_second_local_run_of_the_same_job_refuses(tmp_path):
    python = write_exe(tmp_path / "python", RECORDER)
    job_dir = tmp_path / "job"
    text = render_case("local", job_dir=str(job_dir), repo_dir=str(tmp_path), python=str(python))["submit.sh"]
    (tmp_path / "submit.sh").write_text(text)
    env = {**os.environ, "FAKE_LOG": str(tmp_path)}
    job_dir.mkdir()
    with open(job_dir / "job.lock", "a") as held:  # the first run, still going
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        out = subprocess.run(["bash", str(tmp_path / "submit.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and out.stderr.startswith("error: this job is already running"), out.stderr
    assert not (tmp_path / "python.jsonl").exists()  # nothing started
    # Once the first run has ended (its lock went with it), the job runs again.
    out = subprocess.run(["bash", str(tmp_path / "submit.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "python.jsonl").read_text().splitlines()) == 1


# --- 9. a failed stage cancels the next; data preparation is a small CPU job ---------------------


def test_dependencies_and_the_data_preparation_stage():
    files = render_case("slurm_apptainer")
    for name in ("data_preparation.sbatch", "training.sbatch"):
        assert "#SBATCH --kill-on-invalid-dep=yes\n" in files[name]
    prep = files["data_preparation.sbatch"]
    for inherited in ("--exclusive", "--gpus-per-node", "--mem", "--nv", "--requeue\n"):
        assert inherited not in prep, inherited
    assert "#SBATCH --ntasks=1\n#SBATCH --cpus-per-task=2\n" in prep  # data.workers


# --- 10. the rendezvous port comes from the job -------------------------------------------------


def test_rendezvous_port_is_derived_from_the_job():
    sbatch = render_case("slurm_pyxis")["training.sbatch"]
    assert "rdzv_port=$((15000 + SLURM_JOB_ID % 15000))" in sbatch
    assert '--rdzv-endpoint="${head_node}:${rdzv_port}"' in sbatch and ":29500" not in sbatch
    # Two local jobs (two names) get two ports; an explicit port is kept.
    assert derived_port("train-20260101-000000") != derived_port("train-20260101-000001")
    two_node = render_case("local_two_node")["submit.sh"]
    assert "--master-addr=127.0.0.1 --master-port=29400 --node-rank=1" in two_node
    assert "--master-addr=127.0.0.1 --master-port=29400 --node-rank=0" in two_node
    assert f"--master-port={derived_port('train-golden')}" in render_case("local_two_node_gpu")["submit.sh"]


# --- 11. containers: no leaked home or environment; the caller's uid ---------------------------


def test_apptainer_is_clean_and_docker_runs_as_the_caller():
    sbatch = render_case("slurm_apptainer")["training.sbatch"]
    assert "apptainer exec --nv --no-home --cleanenv " in sbatch
    # The job's variables go in explicitly, still by reference (the secret's value is never written).
    assert 'export APPTAINERENV_HF_TOKEN="${HF_TOKEN}"' in sbatch
    assert 'export APPTAINERENV_HF_HOME="${HF_HOME}"' in sbatch
    docker = render_case("local_docker")["submit.sh"]
    assert 'docker run --rm --network=host --ipc=host --user "$(id -u):$(id -g)" ' in docker


# --- 12. every $ is escaped for Kubernetes ---------------------------------------------------------


def test_kubernetes_expansion_gives_back_the_users_values():
    container = _manifest()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GREETING"] == "$$(HOME)-$$$$x"  # was "$$(HOME)-$$x": Kubernetes turned $$x into $x
    operator = {"MASTER_ADDR": "master-0", "MASTER_PORT": "29500", "HOME": "/root"}
    assert _k8s_expand(env["GREETING"], operator) == "$(HOME)-$$x"
    command = [_k8s_expand(a, operator) for a in container["command"]]
    assert "checkpoint.dir='$(HOME)/ckpt; rm -rf ~'" in command  # main.py gets the user's text
    assert "--rdzv-endpoint=master-0:29500" in command  # our own $(...) still expands


# --- what operators expect --------------------------------------------------------------------------


def test_escape_hatches_are_written_as_given():
    sbatch = render_case("slurm_pyxis")["training.sbatch"]
    assert "#SBATCH --constraint=h100\n" in sbatch
    assert "--kill-on-bad-exit=1 --mpi=pmix \\\n" in sbatch
    assert "\nmodule load cuda/12.8\n" in sbatch
    assert "cluster.sbatch_extra" in _refusal(["cluster=slurm", "cluster.sbatch_extra=['--comment=a b']"])


def test_pytorchjob_with_scheduling_fields_validates_against_the_schemas():
    import jsonschema
    import kubernetes_validate

    manifest = _manifest()
    jsonschema.validate(manifest, PYTORCHJOB)
    spec = manifest["spec"]
    assert spec["nprocPerNode"] == "8" and spec["runPolicy"]["ttlSecondsAfterFinished"] == 3600
    assert spec["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 3,
        "queue": "training",
        "priorityClass": "high-priority",
    }
    for role, replica in spec["pytorchReplicaSpecs"].items():
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"train-golden-{role.lower()}"},
                "template": replica["template"],
            },
            "1.37.0",
            strict=True,
        )
        pod = replica["template"]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
        assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert (pod["schedulerName"], pod["priorityClassName"], pod["serviceAccountName"]) == (
            "volcano",
            "high-priority",
            "trainer",
        )
        container = pod["containers"][0]
        assert container["resources"]["limits"]["rdma/ib"] == 1 and container["imagePullPolicy"] == "Always"
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert replica["template"]["metadata"]["annotations"] == {"team": "llm"}
    # The schemas really check: a misplaced field and a wrong type are refused.
    broken = _manifest()
    broken["spec"]["runPolicy"]["minAvailable"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PYTORCHJOB)
    broken = _manifest()
    broken["spec"]["nprocPerNode"] = 8
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, PYTORCHJOB)
    broken = _manifest()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    broken["spec"]["tolerations"][0]["tolerationSeconds"] = "soon"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": broken},
            "1.37.0",
            strict=True,
        )


@pytest.mark.parametrize(
    "args, field",
    [
        (["cluster=k8s", "container.image=x:1", "cluster.gang_scheduling=true"], "cluster.scheduler_name"),
        (["cluster=k8s", "container.image=x:1", "cluster.ib_resources={rdma/ib: 0}"], "cluster.ib_resources"),
        (["cluster=k8s", "container.image=x:1", "cluster.mem=lots"], "cluster.mem"),
        (["cluster=k8s", "container.image=x:1", "cluster.image_pull_policy=Sometimes"], "cluster.image_pull_policy"),
        (["cluster=k8s", "container.image=x:1", "container.runtime=docker"], "container.runtime=docker"),
        (["cluster=slurm", "cluster.mem=lots"], "cluster.mem"),
        (["cluster=slurm", "cluster.no_such=1"], "cluster.no_such: no such setting of cluster=slurm"),
        (["cluster=slurm", "cluster.local_ranks_filter=first"], "cluster.local_ranks_filter"),
        (["cluster=slurm", "cluster.max_restarts=-1"], "cluster.max_restarts"),
        (["cluster=local", "cluster.partition=batch"], "cluster.partition is a setting of cluster=slurm"),
        (["cluster=slurm", "cluster.node_selector={a: b}"], "cluster.node_selector is a setting of cluster=k8s"),
        (["cluster=slurm", "container.mounts=[data:/data]"], "container.mounts"),
    ],
)
def test_launcher_settings_refusals_name_the_field(args, field):
    assert field in _refusal(args)


def test_time_limit_gives_the_trainer_its_own_stop():
    # With the warning: a backstop half the warning's lead before the limit (04:00:00 - 60 s).
    assert "trainer.max_time_minutes=239.0" in render_case("slurm_pyxis")["training.sbatch"]
    # Without requeue (no warning): 5 minutes before the 30-minute limit.
    assert "trainer.max_time_minutes=25.0" in render_case("slurm_none")["training.sbatch"]
    # The user's own value is kept.
    p = plan_of(
        [
            "cluster=slurm",
            *TINY,
            "cluster.gpus_per_node=0",
            "cluster.nproc_per_node=2",
            "cluster.cpus_per_task=2",
            "trainer.max_time_minutes=7",
        ]
    )
    assert not any("max_time" in o for o in p.training_only) and p.cfg.trainer.max_time_minutes == 7


def test_data_and_checkpoint_folders_are_mounted_into_the_container():
    sbatch = render_case("slurm_pyxis")["training.sbatch"]
    mounts = re.search(r"--container-mounts=(\S+)", sbatch).group(1).split(",")
    assert mounts == [
        f"{JOB_DIR}:{JOB_DIR}",
        "/lustre/data:/data:ro",
        "/lustre/corpus:/lustre/corpus",
        "/lustre/models/llama-7b:/lustre/models/llama-7b",
    ]
    apptainer = render_case("slurm_apptainer")["training.sbatch"]
    assert "/shared/ckpt/llama-1b:/shared/ckpt/llama-1b" in apptainer
    assert f"mkdir -p {JOB_DIR}/run /shared/ckpt/llama-1b\n" in apptainer  # a mount source must exist


def test_torchrun_options_operators_use():
    sbatch = render_case("slurm_apptainer")["training.sbatch"]
    assert "--rdzv-conf=join_timeout=900" in sbatch  # slow image pulls
    assert f"--log-dir={JOB_DIR}/logs/ranks --tee=3" in sbatch  # cluster.rank_logs=true
    # Restarts everywhere (a dead rank restarts the group, which resumes: checkpoint.resume=auto).
    for case in CASES:
        for name, text in render_case(case).items():
            if "torch.distributed.run" in text:
                assert "--max-restarts=3" in text, (case, name)
    p = plan_of(["cluster=local", *TINY, "cluster.local_ranks_filter=0", "cluster.max_restarts=1"])
    (argv,) = __import__("launcher_scripts.local", fromlist=["x"]).render_local_commands(
        p.cfg, make_job(p, JOB_DIR, "/r", "/p")
    )
    assert "--local-ranks-filter=0" in argv and "--max-restarts=1" in argv


def test_slurm_logs_show_the_running_copy_never_a_literal_glob(tmp_path):
    """`launcher logs` tails the submission that is running: not the last id of a requeue chain
    (a copy that has not started has no log), and without job_ids the logs that exist."""
    logs = tmp_path / "logs"
    logs.mkdir()
    tail = lambda ids: lifecycle.lifecycle_commands("logs", "slurm", "train-x", str(tmp_path), ids)[0]
    assert tail([]) == ["ls", "-l", str(logs)]  # nothing written yet, no ids: no literal '*'
    assert tail(["101", "102"])[-1] == f"{logs}/train-x-101.out"  # queued: the first submission
    (logs / "train-x-101.out").write_text("step 1\n")
    assert tail(["101", "102"])[-1] == f"{logs}/train-x-101.out"  # 102 is a chained copy, not started
    (logs / "train-x-102.out").write_text("step 9\n")
    os.utime(logs / "train-x-101.out", (1, 1))
    assert tail(["101", "102"])[-1] == f"{logs}/train-x-102.out"  # the requeued copy now runs
    assert tail([])[-1] == f"{logs}/train-x-102.out"  # no job_ids file: the newest log there is


def test_lifecycle_commands_per_backend():
    ids = ["101", "102"]
    assert lifecycle.lifecycle_commands("cancel", "slurm", "train-x", "/j", ids) == [["scancel", "101", "102"]]
    status = lifecycle.lifecycle_commands("status", "slurm", "train-x", "/j", ids)
    assert status[0][:3] == ["squeue", "--jobs=101,102", "--states=all"] and status[1][0] == "sacct"
    assert lifecycle.lifecycle_commands("cancel", "k8s", "train-x", "/j", [], "research") == [
        ["kubectl", "delete", "pytorchjob", "train-x", "--namespace=research"]
    ]
    assert lifecycle.lifecycle_commands("logs", "k8s", "train-x", "/j", [], "research") == [
        ["kubectl", "logs", "--namespace=research", "train-x-master-0", "--tail=100"]
    ]


SBATCH = (
    RECORDER
    + """calls = open(os.path.join(os.environ["FAKE_LOG"], "sbatch.jsonl")).read().splitlines()
print(f"{100 + len(calls)};cluster-a")
"""
)


def test_status_and_cancel_from_the_job_directory(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    write_exe(bin_dir / "sbatch", SBATCH)
    for name in ("squeue", "sacct", "scancel"):
        write_exe(bin_dir / name, RECORDER)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path)}
    out = run_launcher(
        [
            "cluster=slurm",
            *TINY,
            "cluster.nproc_per_node=2",
            "cluster.gpus_per_node=0",
            "cluster.cpus_per_task=2",
            f"cluster.jobs_dir={tmp_path}/jobs",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    job_dir = out.stdout.strip().splitlines()[-1]
    # Submitted again (a resubmission): both ids are kept.
    subprocess.run(["bash", f"{job_dir}/submit.sh"], env={**os.environ, **env}, check=True, capture_output=True)
    assert Path(job_dir, "job_ids").read_text().split() == ["101", "102"]
    for action in ("status", "cancel"):
        out = run_launcher([action, job_dir], cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr
    calls = {
        name: [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("squeue", "sacct", "scancel")
    }
    assert calls["squeue"][0][0] == "--jobs=101,102" and calls["scancel"] == [["101", "102"]]
    out = run_launcher(["status", str(tmp_path)], cwd=tmp_path, env=env)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "launcher.yaml" in out.stderr


def test_the_pod_entry_passes_sigterm_on_and_asks_for_a_restart_after_the_save(tmp_path):
    """Pod deletion or eviction: SIGTERM reaches torchrun and the ranks, which save and exit 75;
    the pod exits 128 + 75, which the ExitCode policy restarts (and the run resumes)."""
    import signal
    import sys
    import time

    from conftest import REPO

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher_scripts.pod_entry", sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc_per_node=2", str(REPO / "main.py"), *TINY, "trainer.max_steps=100000", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + 75, err[-3000:]
    assert "pod exit status 203" in err and "saved checkpoint" in err, err[-3000:]


def test_memory_snapshots_without_restarts_are_refused_naming_both_settings():
    """torchrun restarts the ranks cluster.max_restarts times; with none, a memory snapshot is never read."""
    assert _refusal(["cluster=slurm", "cluster.max_restarts=0", "checkpoint.memory_interval=5"]) == (
        "checkpoint.memory_interval=5: memory snapshots are read only by restarted ranks, and this job has "
        "cluster.max_restarts=0; run it with cluster.max_restarts=N (N > 0), or set checkpoint.memory_interval=0"
    )
    plan_of(["cluster=slurm", "checkpoint.memory_interval=5", *SMALL])  # the default, 3 restarts: planned
