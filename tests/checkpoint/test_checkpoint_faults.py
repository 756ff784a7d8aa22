"""Checkpoint faults, in one process (a 1-rank gloo group) on a small model: a save that cannot be
written, manifests that cannot be trusted, a resume whose optimizer or hyper-parameters differ.

The save is the manager's own code path; only the file system's answer is simulated (a write that
fills the disk half-way, a read-only directory), since the tests cannot fill a real disk.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

from framework.runtime import Runtime, free_port


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Loader:
    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed_samples"]


def _cfg(tmp_path, *overrides):
    from framework.config import compose_config, to_config

    cfg = to_config(
        compose_config(
            ["model=debug", "data=synthetic", "parallelism.engine=torch", "checkpoint.keep_last=5", *overrides]
        )
    )
    cfg.run_dir = str(tmp_path)
    return cfg


def _state(step: int, lr: float = 0.1):
    from framework.train_state import TrainState

    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # so the optimizer has state (exp_avg, ...) to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainState(model, optimizer, scheduler, _Loader(), step=step)


def _manager(cfg):
    from framework.checkpoint import CheckpointManager

    return CheckpointManager(cfg, cfg.run_dir, Runtime(0, 1, 0, torch.device("cpu")))


def _step_dirs(root):
    return sorted(p for p in os.listdir(root) if p.startswith("step_"))


@pytest.mark.parametrize("fault", ["disk_full_during_shards", "read_only_directory"])
def test_failed_save_keeps_the_previous_checkpoint_latest_and_complete(tmp_path, one_rank_group, monkeypatch, fault):
    from framework.checkpoint import layout, manager
    from framework.checkpoint.manager import CheckpointWriteError

    cfg = _cfg(tmp_path)
    mgr = _manager(cfg)
    mgr.save(_state(2))
    root = mgr.root
    if fault == "disk_full_during_shards":

        def save(app, checkpoint_id):  # half a shard written, then the disk is full
            path = os.path.join(checkpoint_id, "__0_0.distcp")
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

        monkeypatch.setattr(manager.dcp, "save", save)
        cause = "No space left on device"
    else:

        def write_rng(ckpt, rank):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.path.join(ckpt, "rng"))

        monkeypatch.setattr(manager, "write_rng", write_rng)
        cause = "Read-only file system"
    with pytest.raises(CheckpointWriteError) as exc:
        mgr.save(_state(4))
    message = str(exc.value)
    assert "\n" not in message and cause in message and "step_00000004.tmp-" in message, message
    assert "step_00000002 stays the latest checkpoint" in message, message
    # No partial files left: only the complete step-2 checkpoint, still `latest`, still verifiable.
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
    path = layout.latest_checkpoint(root)
    assert path.endswith("step_00000002")
    files = layout.read_manifest(path)["files"]
    assert layout.verify_files(path, files, sorted(files)) == []
    monkeypatch.undo()
    restored = _state(99)
    assert mgr.load(restored, path) == 2
    for a, b in zip(restored.model.parameters(), _state(2).model.parameters()):
        assert torch.equal(a, b)  # a checkpoint restores exactly (same values, no arithmetic)


def test_checkpoint_dir_that_is_a_file_is_refused(tmp_path, one_rank_group):
    from framework.errors import UserInputError

    (tmp_path / "ckpts").write_text("not a directory")
    with pytest.raises(UserInputError, match=r"checkpoint.dir=.*ckpts is a file, not a directory"):
        _manager(_cfg(tmp_path, f"checkpoint.dir={tmp_path / 'ckpts'}"))


@pytest.mark.parametrize("damage", ["not_json", "no_files", "empty_files", "unlisted_file"])
def test_untrustworthy_manifest_names_the_file_and_the_previous_good_checkpoint(tmp_path, one_rank_group, damage):
    from framework.checkpoint import CheckpointError

    mgr = _manager(_cfg(tmp_path))
    mgr.save(_state(2))
    mgr.save(_state(4))
    bad = os.path.join(mgr.root, "step_00000004")
    manifest_path = os.path.join(bad, "manifest.json")
    manifest = json.load(open(manifest_path))
    if damage == "not_json":
        open(manifest_path, "w").write("{ truncated")
    elif damage == "unlisted_file":
        shutil.copy(os.path.join(bad, "train_state.json"), os.path.join(bad, "extra.distcp"))
    else:
        if damage == "no_files":
            del manifest["files"]
        else:
            manifest["files"] = {}
        json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError) as exc:
        mgr.load(_state(0), bad)
    message = str(exc.value)
    expected = {
        "not_json": f"{manifest_path} is not JSON",
        "no_files": "lists no files (`files` is missing)",
        "empty_files": "lists no files (`files` is {})",
        "unlisted_file": "extra.distcp is not listed",
    }
    assert expected[damage] in message, message
    assert f"checkpoint.resume={os.path.join(mgr.root, 'step_00000002')}" in message, message
    assert "\n" not in message


def test_resume_warns_about_overridden_hyper_parameters_and_refuses_another_optimizer(tmp_path, one_rank_group, capsys):
    from framework.checkpoint import CheckpointError

    mgr = _manager(_cfg(tmp_path, "optimizer.lr=0.01"))
    mgr.save(_state(2))
    path = os.path.join(mgr.root, "step_00000002")
    _manager(_cfg(tmp_path, "optimizer.lr=0.05")).load(_state(0), path)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "optimizer.lr=0.05 (the checkpoint's 0.01 is used)" in warnings[0], warnings
    with pytest.raises(
        CheckpointError, match="saved with optimizer.name=adamw; its state does not fit optimizer.name=sgd"
    ):
        _manager(_cfg(tmp_path, "optimizer=sgd", "optimizer.lr=0.01")).load(_state(0), path)
