"""Checkpoints through `main.py`, as a user saves and resumes, on the tiny model and synthetic data.

One uninterrupted 2-rank run (engine=torch, 12 steps, a checkpoint every 6 steps, safetensors
export at the end) is the reference; every other run starts from one of its checkpoints and must
log the reference's losses for the steps it trains:

* same layout, same engine: bitwise (CPU, fp32, gloo: the same operations in the same order);
* the other engine, both ways (torch -> native -> torch): bitwise too, since both engines reduce
  the same shards in the same order (if that ever changes, the tolerance below is the fallback);
* another world size (1 and 4 ranks): within 1e-5. The step's loss is a mean over the same 8
  samples (see [Note: global sample order] in framework/data/loader.py), but summed in another
  order (per-rank micro-batches, gradient averaging over 1, 2 or 4 ranks): float32 rounding, a few
  ulps of a loss near 5 (~5e-7 measured), grows over 6 Adam steps to well under 1e-5.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY, rank_pids, read_metrics, run_main, start_main

from framework.errors import EXIT_REQUEUE

COMMON = TINY + [
    "checkpoint.save_final=true",
    "trainer.eval_interval=0",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    "trainer.max_steps=12",
]
WORLD_TOLERANCE = 1e-5  # see the module docstring


def _losses(run_dir: Path) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def _ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The reference: 12 steps on 2 ranks, checkpoints at 6 and 12, an export at the end. Saved
    asynchronously: the resume tests then also show that training on while the step-6
    checkpoint is written does not leak step-7+ values into it (the other runs save in line)."""
    root = tmp_path_factory.mktemp("ckpt_source")
    _ok(
        run_main(
            COMMON
            + [
                "parallelism.engine=torch",
                "checkpoint.interval=6",
                "checkpoint.export_safetensors=true",
                "checkpoint.async_save=true",
                f"hydra.run.dir={root}/run",
            ],
            root,
        )
    )
    return root / "run"


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_checkpoint_is_complete(source):
    from framework.checkpoint.layout import sha256_of

    ckpts = source / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000012"
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name], "a temp directory was left behind"
    manifest = json.loads((_ckpt(source, 12) / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["complete"]
    assert manifest["world"]["world_size"] == 2 and manifest["world"]["engine"] == "torch"
    assert manifest["config"]["trainer"]["max_steps"] == 12 and manifest["versions"]["torch"]
    assert manifest["git"]
    names = set(manifest["files"])
    assert {"rng/rank_00000.json", "rng/rank_00001.json", "train_state.json", ".metadata"} <= names
    assert any(n.startswith("__1_") for n in names), "rank 1 wrote no shard of its own"
    for name, entry in manifest["files"].items():
        assert sha256_of(str(_ckpt(source, 12) / name)) == entry["sha256"], name
    state = json.loads((_ckpt(source, 12) / "train_state.json").read_text())
    assert state["step"] == 12 and state["train_loader"] == {"consumed_samples": 12 * 8}
    assert state["scheduler"]["last_epoch"] == 12 and state["optimizer_param_groups"]


def test_exact_resume_is_bitwise(source, tmp_path):
    out = run_main(
        COMMON
        + [
            "parallelism.engine=torch",
            f"checkpoint.resume={_ckpt(source, 6)}",
            "checkpoint.save_final=false",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    _ok(out)
    assert "resumed from" in out.stderr and "at step 6" in out.stderr
    want, got = _losses(source), _losses(tmp_path / "run")
    assert sorted(got) == list(range(7, 13))
    assert [got[s] for s in got] == [want[s] for s in got], "6 + resume + 6 differs from 12 straight"


@pytest.fixture(scope="module")
def native_resumed(source, tmp_path_factory) -> Path:
    """torch checkpoint (step 6) -> native engine, saving at step 9."""
    root = tmp_path_factory.mktemp("ckpt_native")
    _ok(
        run_main(
            COMMON
            + [
                "parallelism.engine=native",
                f"checkpoint.resume={_ckpt(source, 6)}",
                "checkpoint.interval=3",
                "checkpoint.save_final=false",
                f"hydra.run.dir={root}/run",
            ],
            root,
        )
    )
    return root / "run"


def test_resume_torch_checkpoint_in_native_engine(source, native_resumed):
    want, got = _losses(source), _losses(native_resumed)
    assert sorted(got) == list(range(7, 13))
    for step in got:
        assert abs(got[step] - want[step]) <= WORLD_TOLERANCE, (step, got[step], want[step])


def test_resume_native_checkpoint_in_torch_engine(source, native_resumed, tmp_path):
    manifest = json.loads((_ckpt(native_resumed, 9) / "manifest.json").read_text())
    assert manifest["world"]["engine"] == "native"
    _ok(
        run_main(
            COMMON
            + [
                "parallelism.engine=torch",
                f"checkpoint.resume={_ckpt(native_resumed, 9)}",
                "checkpoint.save_final=false",
                f"hydra.run.dir={tmp_path}/run",
            ],
            tmp_path,
        )
    )
    want, got = _losses(source), _losses(tmp_path / "run")
    assert sorted(got) == [10, 11, 12]
    for step in got:
        assert abs(got[step] - want[step]) <= WORLD_TOLERANCE, (step, got[step], want[step])


@pytest.mark.parametrize("ranks", [1, 4])
def test_resume_at_another_world_size(source, tmp_path, ranks):
    out = run_main(
        COMMON
        + [
            "parallelism.engine=torch",
            f"cluster.nproc_per_node={ranks}",
            f"checkpoint.resume={_ckpt(source, 6)}",
            "checkpoint.save_final=false",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    _ok(out)
    assert f"now {ranks} ranks" in out.stderr
    want, got = _losses(source), _losses(tmp_path / "run")
    assert sorted(got) == list(range(7, 13))
    for step in got:
        assert abs(got[step] - want[step]) <= WORLD_TOLERANCE, (
            f"step {step} resumed on {ranks} ranks: {got[step]:.8f}, uninterrupted 2 ranks {want[step]:.8f}"
        )


@pytest.mark.parametrize("boundary,ranks", [("rows", 4), ("params", 2)])
def test_resume_under_another_shard_boundary(native_resumed, tmp_path, boundary, ranks):
    """A checkpoint written with tight shard boundaries (step 9 of `native_resumed`) resumes with
    whole-row or whole-parameter pieces (and another world size) on the uninterrupted losses: the
    checkpoint holds each parameter whole, whatever the layout ([Note: shard boundaries])."""
    _ok(
        run_main(
            COMMON
            + [
                "parallelism.engine=native",
                f"parallelism.shard_boundary={boundary}",
                f"cluster.nproc_per_node={ranks}",
                f"checkpoint.resume={_ckpt(native_resumed, 9)}",
                "checkpoint.save_final=false",
                f"hydra.run.dir={tmp_path}/run",
            ],
            tmp_path,
        )
    )
    want, got = _losses(native_resumed), _losses(tmp_path / "run")
    assert sorted(got) == [10, 11, 12]
    for step in got:
        assert abs(got[step] - want[step]) <= WORLD_TOLERANCE, (step, got[step], want[step])


def _samples_of_steps(consumed: int, dp: int, steps: int, micro: int = 2, global_batch: int = 8) -> list:
    """The global sample indices each step reads, over all dp ranks (GlobalBatchLoader's order)."""
    from framework.data.loader import GlobalBatchLoader
    from framework.data.synthetic import SyntheticSource

    loaders = [
        GlobalBatchLoader(
            SyntheticSource(256, 8, 0, size=10_000),
            micro_batch_size=micro,
            global_batch_size=global_batch,
            dp_rank=r,
            dp_size=dp,
        )
        for r in range(dp)
    ]
    for loader in loaders:
        loader.load_state_dict({"consumed_samples": consumed})
    out = []
    for _ in range(steps):
        seen = []
        for _ in range(loaders[0].accum_steps):
            for loader in loaders:
                seen += loader.sample_indices()
                loader.next_batch()
        out.append(sorted(seen))
    return out


def test_no_sample_repeated_or_skipped_across_resumes(source):
    """The data position a checkpoint stores, resumed at 1, 2 or 4 ranks, reads exactly the
    samples the uninterrupted run reads next: none twice, none left out."""
    state = json.loads((_ckpt(source, 6) / "train_state.json").read_text())
    consumed = state["train_loader"]["consumed_samples"]
    assert consumed == 6 * 8
    before = _samples_of_steps(0, dp=2, steps=6)
    straight = _samples_of_steps(0, dp=2, steps=12)
    for dp in (1, 2, 4):
        after = _samples_of_steps(consumed, dp=dp, steps=6)
        assert before + after == straight, f"resume at dp={dp} reads other samples"
        flat = [i for step in before + after for i in step]
        assert sorted(flat) == list(range(12 * 8)), f"dp={dp}: a sample repeated or skipped"


def test_corrupted_shard_is_refused_naming_the_previous_checkpoint(source, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(source / "checkpoints", run / "checkpoints")
    shard = _ckpt(run, 12) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = run_main(
        COMMON
        + [
            "parallelism.engine=torch",
            "cluster.nproc_per_node=1",
            "checkpoint.resume=auto",
            "trainer.max_steps=13",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    line = [text for text in out.stderr.splitlines() if text.startswith("error:")]
    assert line and "failed its integrity check" in line[0] and "__1_0.distcp" in line[0], out.stderr[-2000:]
    assert f"checkpoint.resume={_ckpt(run, 6)}" in line[0]
    assert "Traceback" not in out.stderr


def test_safetensors_export_equals_sharded_weights(source):
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from framework.checkpoint.contents import TensorsOnlyLoadPlanner
    from framework.models.llama.adapter import to_hf_name

    export = source / "checkpoints" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2 and config["vocab_size"] == 256
    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}
    assert "model.layers.1.self_attn.k_proj.weight" in exported and "lm_head.weight" in exported
    # The step-12 checkpoint read back on one process, without any process group.
    meta = dcp.FileSystemReader(str(_ckpt(source, 12))).read_metadata()
    model = {
        k[len("model.") :]: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.")
    }
    dcp.load({"model": model}, checkpoint_id=str(_ckpt(source, 12)), planner=TensorsOnlyLoadPlanner(), no_dist=True)
    assert len(model) == len(exported)
    for name, tensor in model.items():
        assert torch.equal(exported[to_hf_name(name)], tensor), name


def _import_rank(rank, world, export_dir, run_dir):
    """Start a 2-rank job from the export; return the names whose gathered weights differ from
    the file (plain strings: tensors through the harness's queue would outlive their sender)."""
    from safetensors import safe_open

    from framework.config import to_config
    from framework.config.compose import compose_config
    from framework.distributed.engines import engine_of
    from framework.models.llama.adapter import to_hf_name
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    cfg = to_config(compose_config(COMMON + ["parallelism.engine=torch", f"checkpoint.init_from={export_dir}"]))
    cfg.run_dir = run_dir
    trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
    assert trainer.ckpt.resume(trainer.state) == 0
    model_sd, _ = engine_of(cfg.parallelism.engine).get_state_dicts(trainer.model, trainer.optimizer)
    different, compared = [], 0
    with safe_open(os.path.join(export_dir, "model.safetensors"), framework="pt") as f:
        for name, value in model_sd.items():
            full = value.full_tensor()
            compared += 1
            if not torch.equal(full, f.get_tensor(to_hf_name(name))):
                different.append(name)
    trainer.ckpt.close()
    return different, compared


def test_import_from_safetensors_equals_the_export(source, tmp_path):
    from tests.distributed.harness import run_ranks

    export = source / "checkpoints" / "export"
    for different, compared in run_ranks(_import_rank, world_size=2, args=(str(export), str(tmp_path)), timeout_s=120):
        assert compared == 21 and different == []


def _kill_in_commit_rank(rank, world, run_dir):
    """Resume the copied run, train 2 more steps and die (SIGKILL) in the middle of the step-14
    save: after every shard is written, before the rename."""
    import framework.checkpoint.layout as layout
    from framework.config import to_config
    from framework.config.compose import compose_config
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    layout.commit = die
    cfg = to_config(
        compose_config(COMMON + ["parallelism.engine=torch", "checkpoint.resume=auto", "trainer.max_steps=14"])
    )
    cfg.run_dir = run_dir
    build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage)).fit()


def test_kill_9_during_save_leaves_the_previous_checkpoint_loadable(source, tmp_path):
    from framework.local_ranks import RanksFailed
    from tests.distributed.harness import run_ranks

    run = tmp_path / "run"
    shutil.copytree(source / "checkpoints", run / "checkpoints")
    with pytest.raises(RanksFailed):
        run_ranks(_kill_in_commit_rank, world_size=2, args=(str(run),), timeout_s=120)
    ckpts = run / "checkpoints"
    assert [p.name for p in ckpts.iterdir() if p.name.startswith("step_00000014.tmp-")], (
        "the killed save should have left its temp directory"
    )
    assert not _ckpt(run, 14).exists()
    assert (ckpts / "latest").read_text().strip() == "step_00000012"
    out = run_main(
        COMMON
        + [
            "parallelism.engine=torch",
            "checkpoint.resume=auto",
            "trainer.max_steps=13",
            "cluster.nproc_per_node=1",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    _ok(out)
    assert "at step 12" in out.stderr
    assert not [p for p in ckpts.iterdir() if ".tmp-" in p.name], "the next save should prune the temp directory"
    assert (ckpts / "latest").read_text().strip() == "step_00000013"


def test_sigterm_saves_exits_requeueable_and_the_next_start_resumes(tmp_path):
    run = tmp_path / "run"
    args = COMMON + [
        "parallelism.engine=torch",
        "trainer.max_steps=100000",
        "optimizer.schedule=constant",
        "checkpoint.resume=auto",
        f"hydra.run.dir={run}",
    ]
    proc = start_main(args, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len(read_metrics(run)) >= 3:
                break
            time.sleep(0.2)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        # SIGTERM on one rank and Slurm's SIGUSR1 on the other (each alone would do: the ranks agree
        # to stop together); either signal's default action would kill its rank instead.
        os.kill(ranks[1], signal.SIGTERM)
        os.kill(ranks[0], signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE, err[-3000:]
    assert "rank 1: received SIGTERM" in err and "rank 0: received SIGUSR1" in err
    step = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= step < 100000
    assert max(_losses(run)) == step, "the checkpoint must be of the last step trained"
    # The next start (same command, as a requeue would run it) continues from there; the time
    # limit stops it again, with the same status.
    out = run_main(args + ["trainer.max_time_minutes=0.002"], tmp_path)
    assert out.returncode == EXIT_REQUEUE, out.stderr[-3000:]
    assert f"at step {step}" in out.stderr and "max_time_minutes" in out.stderr
    steps = [row["step"] for row in read_metrics(run) if "loss" in row]
    assert steps == list(range(1, max(steps) + 1)), "a step was repeated or skipped across the restart"
    later = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert later == max(steps) > step


def test_keep_last_prunes_old_checkpoints_and_leftover_temp_dirs(tmp_path):
    from framework.checkpoint import layout

    for step in (2, 4, 6, 8):
        tmp = tmp_path / f"step_{step:08d}.tmp-abc"
        tmp.mkdir()
        (tmp / "x").write_text(str(step))
        layout.commit(str(tmp), str(tmp_path / f"step_{step:08d}"), {"format": layout.FORMAT_VERSION})
    (tmp_path / "step_00000010.tmp-dead").mkdir()  # a save killed mid-way
    layout.prune(str(tmp_path), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000006", "step_00000008"]
    assert layout.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step_00000008")


def test_loading_refuses_pickled_entries(tmp_path):
    """Nothing in a checkpoint is unpickled: a DCP file holding a non-tensor object (which DCP's
    default planner would load with weights_only=False) is refused."""
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.contents import dcp_load

    dcp.save({"w": torch.ones(3), "extra": {"note": "pickled"}}, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"w": torch.zeros(3), "extra": {"note": ""}}
    from framework.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="extra.note is a pickled object"):
        dcp_load(target, str(tmp_path))


def test_resume_with_another_model_is_one_line(source, tmp_path):
    out = run_main(
        COMMON
        + [
            "parallelism.engine=torch",
            "cluster.nproc_per_node=1",
            "model.args.n_layers=3",
            f"checkpoint.resume={_ckpt(source, 6)}",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: checkpoint.resume:" in out.stderr and "model.args.n_layers=2 there, 3 here" in out.stderr
    assert "Traceback" not in out.stderr
