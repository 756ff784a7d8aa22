"""Runs and files that must not lose data, hang or leave things behind: a rollback that keeps its
own checkpoints, a Megatron index or a data-preparation input that lies or never ends, a disk that
fills during a save, and what a SIGKILLed job leaves outside its run directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, main_env, run_main, start_main, torchrun

from framework.runtime import Runtime, free_port


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Loader:
    consumed = 0

    def state_dict(self):
        return {"consumed_samples": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed_samples"]


def _state(step: int):
    from framework.train_state import TrainState

    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainState(model, optimizer, scheduler, _Loader(), step=step)


def _manager(run_dir: Path, keep_last: int):
    from framework.checkpoint import CheckpointManager
    from framework.config import compose_config, to_config

    cfg = to_config(
        compose_config(
            ["model=debug", "data=synthetic", "parallelism.engine=torch", f"checkpoint.keep_last={keep_last}"]
        )
    )
    cfg.run_dir = str(run_dir)
    return CheckpointManager(cfg, str(run_dir), Runtime(0, 1, 0, torch.device("cpu")))


def _steps(root: Path):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


# ---- item 1: a rollback keeps every checkpoint it saves ----


def test_a_rollback_keeps_its_own_saves_and_resume_auto_continues_from_them(tmp_path, one_rank_group):
    from framework.checkpoint import layout

    first = _manager(tmp_path / "run", keep_last=3)
    for step in (10, 15, 20):
        first.save(_state(step))
    root = Path(first.root)
    elsewhere = tmp_path / "copy" / "step_00000010"
    shutil.copytree(root / "step_00000010", elsewhere)
    shutil.rmtree(root / "step_00000010")
    assert _steps(root) == ["step_00000015", "step_00000020"]

    # The rolled-back run: resumed from the copy of step 10, saving every 3 steps, keep_last=2.
    second = _manager(tmp_path / "run", keep_last=2)
    state = _state(0)
    assert second.load(state, str(elsewhere)) == 10
    for step in (12, 14):
        state.step = step
        second.save(state)
    assert _steps(root) == ["step_00000012", "step_00000014"], "the resumed run's own saves survive"
    assert (root / "latest").read_text().strip() == "step_00000014"
    assert layout.latest_checkpoint(str(root)).endswith("step_00000014")  # what resume=auto takes
    (root / "latest").unlink()  # without the pointer, the last commit, not the highest step
    shutil.copytree(tmp_path / "copy" / "step_00000010", root / "step_00000030")  # an older commit, higher step
    layout.write_json_atomic(str(root / "step_00000030" / "manifest.json"), {"format": 1, "commit": 1})
    assert layout.latest_checkpoint(str(root)).endswith("step_00000014")


# ---- items 4, 7: a Megatron index that lies ----


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from framework.data.prepare import prepare

    root = tmp_path_factory.mktemp("idx")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (20 + i)}) + "\n" for i in range(40)))
    prefix, tok = prepare([str(corpus)], str(root / "c"), vocab_size=300, progress=False)
    return prefix, tok


def _lie(data: bytearray, field: str) -> bytearray:
    count, docs = struct.unpack_from("<QQ", data, 18)
    lengths, pointers = 34, 34 + 4 * count
    if field == "header":
        data[0:1] = b"X"
    elif field == "version":
        struct.pack_into("<Q", data, 9, 7)
    elif field == "dtype_code":
        data[17] = 6  # float64: not a token type
    elif field == "count":
        struct.pack_into("<Q", data, 18, count + 1000)
    elif field == "negative_length":
        struct.pack_into("<i", data, lengths + 4 * 3, -5)
    elif field == "pointer_past_bin":
        struct.pack_into("<q", data, pointers + 8 * (count - 1), 10**12)
    elif field == "document_index":
        struct.pack_into("<q", data, 34 + 12 * count + 8 * (docs - 1), count + 7)
    return data


FIELDS = ["header", "version", "dtype_code", "count", "negative_length", "pointer_past_bin", "document_index"]


@pytest.mark.parametrize("field", FIELDS)
def test_each_lying_index_field_is_one_refusal(prepared, tmp_path, field):
    from framework.data.indexed import check_index
    from framework.errors import UserInputError

    prefix, _ = prepared
    check_index(prefix)  # the real one passes
    copy = str(tmp_path / "c")
    shutil.copy(prefix + ".bin", copy + ".bin")
    Path(copy + ".idx").write_bytes(bytes(_lie(bytearray(Path(prefix + ".idx").read_bytes()), field)))
    with pytest.raises(UserInputError) as exc:
        check_index(copy)
    message = str(exc.value)
    assert "\n" not in message and f"{copy}." in message and message.startswith("data.paths:"), message


def test_a_negative_document_length_ends_the_job_with_status_2(prepared, tmp_path):
    prefix, tok = prepared
    copy = str(tmp_path / "c")
    shutil.copy(prefix + ".bin", copy + ".bin")
    shutil.copy(tok, copy + ".tokenizer.json")
    Path(copy + ".idx").write_bytes(bytes(_lie(bytearray(Path(prefix + ".idx").read_bytes()), "negative_length")))
    args = [a for a in TINY if not a.startswith("data=")] + ["data=indexed", "data.seq_len=16", "data.split='90,10,0'"]
    out = run_main(args + [f"data.paths=[{copy}]", "trainer.max_steps=2", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "negative length" in errors[0] and f"{copy}.idx" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


# ---- item 6: data preparation over special files and very long lines ----


def _prepare(tmp_path: Path, *args: str, timeout: float = 120):
    # the timeout: a FIFO read would hang here; /dev/zero would fill the disk
    return run_main(["stage=data_preparation", *args], tmp_path, timeout=timeout)


def test_data_preparation_reads_regular_files_only_and_names_what_it_skipped(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some words of a document " * 20)
    os.mkfifo(corpus / "b.fifo")
    (corpus / "c.txt").symlink_to("/dev/zero")
    out = _prepare(
        tmp_path, f"data.raw_inputs=[{corpus}]", f"data.output_prefix={tmp_path}/out/c", "data.vocab_size=300"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    warning = next(line for line in out.stderr.splitlines() if line.startswith("warning: data.raw_inputs"))
    assert "skipped 2 entries" in warning and "b.fifo" in warning and "c.txt" in warning, warning
    assert os.path.getsize(tmp_path / "out" / "c.bin") < 100_000
    # A FIFO named directly is refused in one line, not waited on.
    out = _prepare(tmp_path, f"data.raw_inputs=[{corpus / 'b.fifo'}]", f"data.output_prefix={tmp_path}/out2/c")
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "b.fifo is not a regular file" in errors[0], out.stderr[-3000:]
    assert stat.S_ISFIFO(os.stat(corpus / "b.fifo").st_mode)


def test_a_jsonl_line_over_the_stated_size_is_refused_before_it_is_read_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "x" * (3 << 20)}) + "\n")
    out = _prepare(
        tmp_path, f"data.raw_inputs=[{path}]", f"data.output_prefix={tmp_path}/out/c", "data.max_document_mb=1"
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{path}:2 is longer than data.max_document_mb=1" in errors[0], out.stderr[-3000:]
    assert not (tmp_path / "out" / "c.bin").exists()


# ---- item 7: a sync save on a disk that really fills ----


def _mount_tmpfs(path: Path, size: str) -> None:
    """A tmpfs of `size` mounted at `path` (made here). Skips where this is not root; as root (CI)
    a mount that fails fails the test with mount's message."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    path.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if out.returncode:
        pytest.fail(f"mount -t tmpfs failed as root: {out.stderr.strip()}", pytrace=False)


def test_only_a_user_who_is_not_root_skips_the_full_disk_test(monkeypatch, tmp_path):
    """CI runs as root: there a tmpfs that cannot be mounted fails the test with mount's message;
    only where this is not root does the full-disk test skip, saying so."""
    refused = subprocess.CompletedProcess(["mount"], 32, "", "mount: tmpfs: permission denied\n")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: refused)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(pytest.fail.Exception, match="^mount -t tmpfs failed as root: mount: tmpfs: permission denied$"):
        _mount_tmpfs(tmp_path / "small", "300k")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.skip.Exception, match=r"^mounting a tmpfs needs root \(CI runs as root\)$"):
        _mount_tmpfs(tmp_path / "other", "300k")


def test_a_save_on_a_full_disk_is_one_line_naming_it(tmp_path):
    small = tmp_path / "small"
    _mount_tmpfs(small, "300k")
    try:
        out = run_main(
            TINY
            + [
                "trainer.max_steps=4",
                "checkpoint.interval=2",
                f"checkpoint.dir={small}/ck",
                f"hydra.run.dir={tmp_path}/run",
            ],
            tmp_path,
        )
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "No space left on device" in errors[0] and f"{small}/ck" in errors[0], out.stderr
        assert "Traceback" not in out.stderr and "enforce fail" not in out.stderr
        assert os.listdir(small / "ck") == [], "the partial save is removed"
    finally:
        subprocess.run(["umount", str(small)], check=False)


# ---- item 8: what a SIGKILLed job leaves outside its run directory ----


def test_leftovers_of_dead_jobs_are_swept_and_live_ones_kept(tmp_path):
    from framework.fileio import owner_tag, pid_namespace, sweep_dead

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that no longer runs
    ns = pid_namespace()
    dead_dir = tmp_path / f"framework-ranks-{ns}-{child.pid}-abc"
    dead_file = tmp_path / f"framework-ranks-{ns}-{child.pid}-def"
    live = tmp_path / f"framework-ranks-{owner_tag()}-ghi"
    other_ns = tmp_path / f"framework-ranks-1{ns}-{child.pid}-jkl"
    unrelated = tmp_path / "framework-ranks-xyz"
    for d in (dead_dir, live, other_ns, unrelated):
        d.mkdir()
    dead_file.write_text("")
    removed = sweep_dead(str(tmp_path), "framework-ranks-")
    assert sorted(removed) == sorted([str(dead_dir), str(dead_file)])
    assert live.exists() and other_ns.exists() and unrelated.exists()


def test_a_sigkilled_job_leaves_nothing_the_next_start_does_not_sweep(tmp_path):
    import glob
    import tempfile

    from framework.fileio import RANKS_PREFIX, sweep_leftovers

    proc = start_main([*TINY, "trainer.max_steps=200", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    pattern = os.path.join(tempfile.gettempdir(), f"{RANKS_PREFIX}*-{proc.pid}-*")
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)  # the ranks are training
    left = glob.glob(pattern)
    assert left, "the launcher names its report directory after its pid"
    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies at once; its ranks follow it (parent-death signal)
    proc.wait(timeout=60)
    assert all(os.path.exists(p) for p in left)  # what a SIGKILL leaves
    sweep_leftovers()  # what every job start runs
    assert not any(os.path.exists(p) for p in left)
    assert not glob.glob(f"/dev/shm/fsdp-collectives-*-{proc.pid}-*")


# [Note: a refused job leaves the run directory as it found it] (framework/checkpoint/run_lock.py)
def _broken_checkpoint(root: Path) -> Path:
    step = root / "elsewhere" / "step_00000001"
    step.mkdir(parents=True)  # no manifest: refused inside the ranks, after the lock and checkpoints/
    return step


def _tree(run: Path) -> dict:
    return {str(p.relative_to(run)): (p.read_bytes() if p.is_file() else None) for p in sorted(run.rglob("*"))}


@pytest.mark.parametrize("how", ["one rank", "two local ranks", "torchrun"])
def test_a_job_refused_in_its_ranks_leaves_a_fresh_run_directory_absent(tmp_path, how):
    run = tmp_path / "outputs" / "run"
    args = [*TINY, "trainer.max_steps=2", f"checkpoint.resume={_broken_checkpoint(tmp_path)}", f"hydra.run.dir={run}"]
    if how == "torchrun":
        cmd = torchrun(["--nproc_per_node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"], args)
        out = subprocess.run(cmd, cwd=tmp_path, env=main_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and "no manifest.json" in out.stderr, out.stderr[-3000:]
    else:
        out = run_main([*args, f"cluster.nproc_per_node={1 if how == 'one rank' else 2}"], tmp_path)
        assert out.returncode == 2 and "no manifest.json" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "outputs").exists(), sorted(map(str, (tmp_path / "outputs").rglob("*")))


def test_a_job_refused_in_its_ranks_leaves_an_existing_run_directory_as_it_was(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / ".lock").write_text("pid 1 on a host that ran the first job\n")
    (run / "config.yaml").write_text("the first job's config\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _tree(run)
    args = [*TINY, "trainer.max_steps=2", f"checkpoint.resume={_broken_checkpoint(tmp_path)}", f"hydra.run.dir={run}"]
    out = run_main([*args, "cluster.nproc_per_node=1", "checkpoint.interval=1"], tmp_path)
    assert out.returncode == 2 and "no manifest.json" in out.stderr, out.stderr[-3000:]
    after = _tree(run)
    after.pop(".lock")  # rewritten by the job that held it (its holder's pid and host)
    before.pop(".lock")
    assert after == before
    assert (run / ".lock").is_file()
