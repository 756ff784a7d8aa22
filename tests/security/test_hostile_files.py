"""Hostile files: a checkpoint or a data cache from elsewhere must not run code or lead the reader
outside its directory. Each test plants one malicious file and checks that nothing ran (a pickle
payload would create a marker file) and that the refusal is one line naming the file.

Everything but the first test runs in this process against the functions `main.py` goes through
(`CheckpointManager.load` and `build_indexed` call exactly these); the first runs the whole job.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import TINY, run_main


class Payload:
    """Unpickling this runs `touch <marker>` (what an attacker's file would do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps(Payload(marker)))


def _revouch(ckpt: Path, name: str) -> None:
    """Update the manifest's entry for `name` as an attacker who also forged the manifest would."""
    from framework.checkpoint.layout import sha256_of

    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_of(str(ckpt / name)), "bytes": (ckpt / name).stat().st_size}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _one_line(message: str) -> None:
    assert "\n" not in message.strip(), message


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny model (1 rank, 2 steps)."""
    root = tmp_path_factory.mktemp("hostile")
    out = run_main(
        TINY
        + ["cluster.nproc_per_node=1", "trainer.max_steps=2", "trainer.eval_interval=0", "checkpoint.save_final=true"]
        + [f"hydra.run.dir={root}/run"],
        root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root / "run" / "checkpoints" / "step_00000002"


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    """A private copy of the checkpoint, inside a checkpoints directory of its own."""
    target = tmp_path / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def test_pickle_payload_in_dcp_metadata_runs_nothing_and_is_refused(copy, tmp_path):
    marker = tmp_path / "pwned"
    _plant_pickle(copy / ".metadata", marker)
    _revouch(copy, ".metadata")  # the manifest cannot be trusted either: it came with the files
    out = run_main(
        TINY
        + [
            "cluster.nproc_per_node=1",
            "trainer.max_steps=3",
            f"checkpoint.resume={copy}",
            f"hydra.run.dir={tmp_path}/run",
        ],
        tmp_path,
    )
    assert not marker.exists(), "the pickle in .metadata was executed"
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ".metadata names posix.system" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_dcp_metadata_may_not_name_a_shard_outside(copy, tmp_path):
    from framework.checkpoint import CheckpointError
    from framework.checkpoint.safe_reader import load_metadata, read_checked_metadata

    metadata = load_metadata(str(copy / ".metadata"))  # the real one loads through the restricted unpickler
    assert metadata.state_dict_metadata
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = "../../outside.distcp"
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    refusal = r"'\.\./\.\./outside\.distcp', which is not a plain relative path"
    with pytest.raises(CheckpointError, match=refusal) as exc:
        read_checked_metadata(str(copy))
    _one_line(str(exc.value))


def test_latest_pointing_outside_the_checkpoint_dir_is_refused(copy, tmp_path):
    from framework.checkpoint import CheckpointError, latest_checkpoint

    elsewhere = tmp_path / "elsewhere" / "step_00000010"
    shutil.copytree(copy, elsewhere)
    root = copy.parent
    (root / "latest").write_text("../elsewhere/step_00000010\n")
    with pytest.raises(CheckpointError, match="does not hold the name of a step_N directory") as exc:
        latest_checkpoint(str(root))
    _one_line(str(exc.value))
    # A step directory that is a symlink to a checkpoint elsewhere is refused as well.
    (root / "step_00000010").symlink_to(elsewhere, target_is_directory=True)
    (root / "latest").write_text("step_00000010\n")
    with pytest.raises(CheckpointError, match="leads outside"):
        latest_checkpoint(str(root))
    (root / "latest").unlink()  # without the pointer, the newest one is taken: the same refusal
    with pytest.raises(CheckpointError, match="leads outside"):
        latest_checkpoint(str(root))


def test_manifest_paths_stay_inside_and_sizes_outside_never_leak(copy, tmp_path):
    from framework.checkpoint import CheckpointError
    from framework.checkpoint.layout import read_manifest, verify_files

    secret = tmp_path / "secret.txt"
    secret.write_text("x" * 1234)
    manifest = json.loads((copy / "manifest.json").read_text())
    for name in ("../../../secret.txt", str(secret)):
        forged = {**manifest, "files": {**manifest["files"], name: {"sha256": "0" * 64, "bytes": 1}}}
        (copy / "manifest.json").write_text(json.dumps(forged))
        with pytest.raises(CheckpointError, match="not a plain relative path") as exc:
            read_manifest(str(copy))
        _one_line(str(exc.value))
        assert "1234" not in str(exc.value)
    # A file of the checkpoint that is a symlink to a file outside, vouched for with the right
    # sha256 and size, is refused without its size being reported.
    (copy / "manifest.json").write_text(json.dumps(manifest))
    (copy / "train_state.json").unlink()
    (copy / "train_state.json").symlink_to(secret)
    problems = verify_files(str(copy), {"train_state.json": {"sha256": "0" * 64, "bytes": 1}}, ["train_state.json"])
    assert problems == ["train_state.json is a symlink or leads outside the checkpoint"]


@pytest.mark.parametrize("files", [None, {}])
def test_manifest_must_vouch_for_files(copy, files):
    from framework.checkpoint import CheckpointError
    from framework.checkpoint.layout import read_manifest

    manifest = json.loads((copy / "manifest.json").read_text())
    if files is None:
        del manifest["files"]
    else:
        manifest["files"] = files
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lists no files") as exc:
        read_manifest(str(copy))
    assert str(copy / "manifest.json") in str(exc.value)


def test_pickle_payload_in_the_data_index_cache_runs_nothing(tmp_path):
    """megatron-core loads its cached indices with numpy.load(allow_pickle=True); ours never unpickles."""
    import numpy

    from framework.data.index_cache import no_pickle_in_megatron_indices
    from framework.errors import UserInputError

    no_pickle_in_megatron_indices()
    from megatron.core.datasets import gpt_dataset

    good = tmp_path / "good.npy"
    numpy.save(good, numpy.arange(5, dtype=numpy.int32))
    assert gpt_dataset.numpy.load(str(good), allow_pickle=True, mmap_mode="r").tolist() == [0, 1, 2, 3, 4]
    marker = tmp_path / "pwned"
    for name in ("document_index.npy", "object_array.npy"):
        bad = tmp_path / name
        if name == "document_index.npy":
            _plant_pickle(bad, marker)  # not an array at all: numpy would unpickle it
            mmap = {"mmap_mode": "r"}
        else:
            numpy.save(bad, numpy.array([Payload(marker)], dtype=object), allow_pickle=True)
            mmap = {}
        with pytest.raises(UserInputError, match="pickled Python objects") as exc:
            gpt_dataset.numpy.load(str(bad), allow_pickle=True, **mmap)
        assert str(bad) in str(exc.value)
    assert not marker.exists(), "a pickle in the index cache was executed"


def test_planted_cache_file_is_refused_when_a_dataset_is_built(tmp_path):
    """The same through build_indexed, on a real cache: the planted file replaces one megatron wrote."""
    from framework.data.indexed import MegatronTokenizerInfo, build_indexed
    from framework.data.prepare import prepare
    from framework.errors import UserInputError

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (20 + i)}) + "\n" for i in range(40)))
    prefix, tok = prepare([str(corpus)], str(tmp_path / "c"), vocab_size=300, progress=False)
    from framework.data.tokenizer import BPETokenizer

    kw = dict(split="90,10,0", seq_len=16, seed=1, tokenizer=BPETokenizer(tok), cache_dir=str(tmp_path / "cache"))
    build_indexed([prefix], [], **kw)
    cached = sorted((tmp_path / "cache").rglob("*document_index.npy"))
    assert cached, list((tmp_path / "cache").rglob("*"))
    marker = tmp_path / "pwned"
    _plant_pickle(cached[0], marker)
    with pytest.raises(UserInputError, match="pickled Python objects"):
        build_indexed([prefix], [], **kw)
    assert not marker.exists()
    assert MegatronTokenizerInfo  # the module's other entry point imports too
