"""Run directories, checkpoints and data files planted or forged by someone else: each test plants
the file and checks the outcome a user needs: one `error:` line naming the file (quoting nothing
from what it points at), the bad-input status 2, no hang past a stated limit, no crash signal, and
no file outside the run directory changed.

The end-to-end tests run `main.py` on 2 ranks (the refusal must reach every rank, not leave one in
a collective); the others call the functions `main.py` goes through on the same files.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import pytest
from conftest import TINY, run_main

SECRET = "root:x:0:0:secret-line-that-must-never-be-quoted"


def _revouch(ckpt: Path, name: str) -> None:
    """Re-hash `name` in the manifest, as whoever forged the file would."""
    from framework.checkpoint.layout import sha256_of

    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_of(str(ckpt / name)), "bytes": (ckpt / name).stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _refused(out, *names: str) -> str:
    """The run ended with status 2 and exactly one `error:` line, naming every one of `names`."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for name in names:
        assert name in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real run directory of the tiny model on 2 ranks: checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("untrusted")
    out = run_main(
        TINY + ["trainer.max_steps=4", "checkpoint.interval=2", "trainer.eval_interval=0", f"hydra.run.dir={root}/run"],
        root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run"


@pytest.fixture
def own_run(run, tmp_path) -> Path:
    """A private copy of the run directory (without the finished job's lock file)."""
    target = tmp_path / "run"
    shutil.copytree(run, target, ignore=shutil.ignore_patterns(".lock"))
    return target


def _resume(run_dir: Path, cwd: Path, *extra: str, timeout: float = 240):
    return run_main(
        TINY
        + ["trainer.max_steps=6", "checkpoint.resume=auto", "trainer.eval_interval=0", f"hydra.run.dir={run_dir}"]
        + list(extra),
        cwd,
        timeout=timeout,
    )


# ---- item 2: a bad `latest` ----


@pytest.mark.parametrize("kind", ["symlink_to_a_secret", "garbage"])
def test_a_bad_latest_is_refused_in_one_line_quoting_nothing(own_run, tmp_path, kind):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    pointer = own_run / "checkpoints" / "latest"
    pointer.unlink()
    if kind == "symlink_to_a_secret":
        pointer.symlink_to(secret)
    else:
        pointer.write_bytes(b"\xff\xfe not a step \x00" * 8)
    line = _refused(_resume(own_run, tmp_path), str(pointer))
    assert "secret-line" not in line and "not a step" not in line, line
    assert secret.read_text() == SECRET + "\n"
    assert sorted(p.name for p in (own_run / "checkpoints").iterdir()) == ["latest", "step_00000002", "step_00000004"]


# ---- item 3: a crafted .metadata ----


def _exponential_hash_pickle(levels: int) -> bytes:
    """A dict whose key is a tuple of a tuple of ... `levels` deep, each level one object twice:
    hashing it takes 2^levels steps. Built only of ints, tuples and a dict (no class is named)."""
    out = bytearray(b"\x80\x04K\x01\x94")  # PROTO 4, BININT1 1, MEMOIZE
    for i in range(levels):
        out += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86\x94"  # BINGET i twice, TUPLE2, MEMOIZE
    out += b"}h" + bytes([levels]) + b"K\x00s."  # EMPTY_DICT, the key, 0, SETITEM, STOP
    return bytes(out)


def _deep_pickle(depth: int) -> bytes:
    return b"\x80\x04)" + b"\x85" * depth + b"."  # an empty tuple wrapped `depth` times (TUPLE1)


@pytest.mark.parametrize(
    "kind,data,reason",
    [
        ("exponential_hash", _exponential_hash_pickle(60), "when shared ones are counted"),
        ("deep_nesting", _deep_pickle(10**6), "nests values more than"),
    ],
)
def test_a_crafted_metadata_is_refused_before_anything_is_built(tmp_path, kind, data, reason):
    from framework.checkpoint import CheckpointError
    from framework.checkpoint.safe_reader import load_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(data)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=reason) as exc:
        load_metadata(str(path))
    assert time.monotonic() - start < 10, "the refusal must come before the work the file asks for"
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)


def test_a_deeply_nested_metadata_ends_the_job_with_status_2_not_a_crash(own_run, tmp_path):
    ckpt = own_run / "checkpoints" / "step_00000004"
    (ckpt / ".metadata").write_bytes(_deep_pickle(10**6))
    _revouch(ckpt, ".metadata")
    _refused(_resume(own_run, tmp_path, timeout=120), str(ckpt / ".metadata"))


# ---- item 4: consistent lies, re-hashed ----


def _forge_metadata(ckpt: Path, change) -> None:
    from framework.checkpoint.safe_reader import load_metadata

    metadata = load_metadata(str(ckpt / ".metadata"))
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _revouch(ckpt, ".metadata")


def _grow_a_piece(metadata) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    entry = next(e for e in metadata.state_dict_metadata.values() if getattr(e, "chunks", None))
    chunk = entry.chunks[0]
    grown = type(chunk.sizes)([s * 1000 for s in chunk.sizes])
    entry.chunks[0] = ChunkStorageMetadata(offsets=chunk.offsets, sizes=grown)


def _move_a_piece_past_its_file(metadata) -> None:
    info = next(iter(metadata.storage_data.values()))
    info.offset = info.offset + 10**9


@pytest.mark.parametrize(
    "change,reason",
    [(_grow_a_piece, "lies outside the tensor's shape"), (_move_a_piece_past_its_file, "is said to lie at bytes")],
)
def test_an_index_that_lies_consistently_is_refused(own_run, tmp_path, change, reason):
    from framework.checkpoint import CheckpointError
    from framework.checkpoint.safe_reader import read_checked_metadata

    ckpt = own_run / "checkpoints" / "step_00000004"
    read_checked_metadata(str(ckpt))  # the real index passes
    _forge_metadata(ckpt, change)
    with pytest.raises(CheckpointError, match=reason) as exc:
        read_checked_metadata(str(ckpt))
    assert "\n" not in str(exc.value)


def test_a_piece_claiming_1000x_its_extent_ends_the_job_with_status_2(own_run, tmp_path):
    ckpt = own_run / "checkpoints" / "step_00000004"
    _forge_metadata(ckpt, _grow_a_piece)
    _refused(_resume(own_run, tmp_path), "lies outside the tensor's shape")


# ---- item 5: planted symlinks are not written through ----


def test_a_planted_lock_symlink_is_refused_and_its_target_unchanged(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".lock").symlink_to(secret)
    out = run_main(TINY + ["trainer.max_steps=2", f"hydra.run.dir={run_dir}"], tmp_path)
    _refused(out, str(run_dir / ".lock"), "symlink")
    assert secret.read_text() == SECRET


def test_planted_temporaries_and_metrics_links_are_not_written_through(tmp_path):
    from framework.checkpoint import layout
    from framework.errors import UserInputError
    from framework.metrics import MetricsLogger

    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    root = tmp_path / "checkpoints"
    tmp = root / "step_00000002.tmp-1"
    tmp.mkdir(parents=True)
    (tmp / "data").write_text("x")
    (root / "latest.tmp").symlink_to(secret)  # the pointer's temporary
    (tmp / "manifest.json.tmp").symlink_to(secret)  # the manifest's temporary
    layout.commit(str(tmp), str(root / "step_00000002"), {"format": 1, "files": {}})
    assert secret.read_text() == SECRET
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "latest.tmp").exists()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(UserInputError, match="metrics.jsonl is a symlink") as exc:
        MetricsLogger(
            str(run_dir),
            enabled=True,
            total_steps=1,
            start_step=0,
            jsonl=True,
            progress_bar=False,
        )
    assert "secret-line" not in str(exc.value)
    assert secret.read_text() == SECRET


# ---- item 7: small checkpoint files that lie; a non-finite timeout ----


@pytest.mark.parametrize("damage", ["train_state_missing_step", "train_state_scheduler_attr", "garbage_rng"])
def test_small_checkpoint_files_that_lie_are_refused_on_every_rank(own_run, tmp_path, damage):
    ckpt = own_run / "checkpoints" / "step_00000004"
    if damage == "garbage_rng":
        name = "rng/rank_00001.json"  # rank 1's only: every rank must still refuse, in one line
        (ckpt / name).write_text(json.dumps({"python": [3, [1, 2], None], "torch": "AAAA"}))
    else:
        name = "train_state.json"
        state = json.loads((ckpt / name).read_text())
        if damage == "train_state_missing_step":
            del state["step"]
        else:
            state["scheduler"]["__class__"] = "os.system"
        (ckpt / name).write_text(json.dumps(state))
    _revouch(ckpt, name)
    _refused(_resume(own_run, tmp_path), str(ckpt / name))


@pytest.mark.parametrize(
    "value, says",
    [
        ("inf", "finite"),
        ("1e-9", "must be from 5 s"),
        ("4.9", "must be from 5 s"),
        ("604801", "to 604800 s (a week)"),
        ("1e10", "to 604800 s (a week)"),
        ("1e15", "to 604800 s (a week)"),
    ],
)
def test_a_collective_timeout_out_of_range_is_refused(tmp_path, value, says):
    """inf never fires; one shorter than the floor (trainer.MIN_COLLECTIVE_TIMEOUT_S) failed every
    rank in the TCP store with C++ frames; above the ceiling (MAX_COLLECTIVE_TIMEOUT_S) 1e10 ended
    in C++ frames and 1e15 in an OverflowError traceback."""
    out = run_main(TINY + [f"trainer.collective_timeout_s={value}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    _refused(out, f"trainer.collective_timeout_s={float(value)}", says)
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_the_collective_timeout_floor_outlasts_the_hung_rank_diagnosis():
    from framework import runtime
    from framework.config.schema import MIN_COLLECTIVE_TIMEOUT_S

    # The diagnosis reads 4 heartbeats; the hung-rank test (tests/reliability) runs at the floor.
    assert MIN_COLLECTIVE_TIMEOUT_S > 4 * runtime.HEARTBEAT_S
