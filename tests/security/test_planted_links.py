"""Links planted at the names a job writes outside its checkpoints (an export, plan.json, a profile,
prepared data): each is replaced by the job's own file, and what it pointed at keeps its bytes.

The policy is framework/fileio.py's ([Note: no writing through planted links]): a file written
whole goes to a temporary created with O_EXCL | O_NOFOLLOW and is renamed over its final name, so a
link at either name is replaced, never written through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import TINY, run_main

SECRET = b"root:x:0:0:secret-bytes-that-must-stay-as-they-are\n"


def _plant(directory: Path, names, secrets: Path) -> dict:
    """A symlink at each of `names` in `directory`, each to its own secret file: {name: secret path}."""
    directory.mkdir(parents=True, exist_ok=True)
    secrets.mkdir(exist_ok=True)
    planted = {}
    for name in names:
        secret = secrets / name.replace("/", "_")
        secret.write_bytes(SECRET)
        (directory / name).symlink_to(secret)
        planted[name] = secret
    return planted


def _untouched(planted: dict) -> None:
    for name, secret in planted.items():
        assert secret.read_bytes() == SECRET, f"written through the link planted at {name}"


def _replaced(directory: Path, planted: dict, temporaries=()) -> None:
    """The job's own regular file stands at each final name; no temporary is left."""
    for name in planted:
        if name in temporaries:
            assert not os.path.lexists(directory / name), f"{name} left behind"
        else:
            assert not (directory / name).is_symlink() and (directory / name).is_file(), name


def _tokenizer(root: Path) -> Path:
    from framework.data.tokenizer import train_bpe

    texts = [f"def f{i}(a):\n    return a + {i}\n" for i in range(60)]
    train_bpe(texts, 300, str(root / "tok.json"))
    return root / "tok.json"


def test_an_export_and_a_profile_replace_links_planted_at_their_names(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = _tokenizer(tmp_path)
    pq.write_table(
        pa.table({"text": [f"def f{i}(a):\n    return a * {i}\n" * 4 for i in range(200)]}), tmp_path / "c.parquet"
    )
    run = tmp_path / "run"
    export = run / "checkpoints" / "export"
    names = [
        "model.safetensors",
        "model.safetensors.tmp",
        "config.json",
        "config.json.tmp",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer.json.tmp",
        "tokenizer_config.json",
    ]
    planted = _plant(export, names, tmp_path / "secrets")
    profile = _plant(run / "profile", ["rank_00000.pt.trace.json", "rank_00001.pt.trace.json"], tmp_path / "secrets")
    out = run_main(
        TINY
        + ["data=hf", f"data.paths=[{tmp_path}/c.parquet]", f"data.tokenizer={tok}", f"data.cache_dir={tmp_path}/cache"]
        + ["data.seq_len=32", "trainer.max_steps=2", "trainer.eval_interval=0", "checkpoint.export_safetensors=true"]
        + ["trainer.profile=true", "trainer.profile_wait=0", "trainer.profile_warmup=0", "trainer.profile_active=1"]
        + [f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    _untouched(planted)
    _untouched(profile)
    _replaced(export, planted, temporaries=[n for n in names if n.endswith(".tmp")])
    _replaced(run / "profile", profile)
    # What stands there now is the export a transformers user reads, and the trace.
    assert json.loads((export / "config.json").read_text())["model_type"] == "llama"
    assert (export / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert json.loads((export / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((export / "generation_config.json").read_text())["max_length"] > 0
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in set(f.keys())
    assert "traceEvents" in json.loads((run / "profile" / "rank_00000.pt.trace.json").read_text())


def test_a_sharded_export_replaces_links_at_its_shards_and_index(tmp_path):
    """The export's multi-file layout (shards plus index), called as the checkpoint manager does."""
    import torch

    from framework.checkpoint.hf import INDEX_FILE, export_safetensors

    class Names:
        def to_hf(self, name):
            return name

    out = tmp_path / "export"
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX_FILE, INDEX_FILE + ".tmp"]
    planted = _plant(out, names, tmp_path / "secrets")
    weights = {"a.weight": torch.ones(4, 4), "b.weight": torch.zeros(4, 4)}
    export_safetensors(weights, Names(), {"model_type": "toy"}, str(out), rank=0, max_shard_bytes=64)
    _untouched(planted)
    _replaced(out, planted, temporaries=[INDEX_FILE + ".tmp"])
    assert json.loads((out / INDEX_FILE).read_text())["weight_map"] == {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }


def test_an_export_directory_planted_as_a_link_is_replaced_not_written_into(tmp_path):
    """`export` itself a link to someone's directory: the job makes its own directory there, and
    the linked directory keeps every file (a stale-file sweep there would delete theirs)."""
    import torch

    from framework.checkpoint.hf import export_safetensors

    class Names:
        def to_hf(self, name):
            return name

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(SECRET)
    (theirs / "config.json").write_bytes(SECRET)
    out = tmp_path / "export"
    out.symlink_to(theirs, target_is_directory=True)
    export_safetensors({"a.weight": torch.ones(2, 2)}, Names(), {"model_type": "toy"}, str(out), rank=0)
    assert (theirs / "model.safetensors").read_bytes() == SECRET and (theirs / "config.json").read_bytes() == SECRET
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "model.safetensors"]
    assert not out.is_symlink() and (out / "model.safetensors").is_file()


def test_a_hugging_face_models_export_extras_replace_planted_links(tmp_path):
    """model=hf copies model.path's tokenizer and generation files next to its export."""
    from framework.config.schema import ModelConfig
    from framework.models.hf.model import HFAdapter

    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (source / name).write_text(json.dumps({"name": name}))
    out = tmp_path / "export"
    planted = _plant(out, ["tokenizer.json", "tokenizer_config.json", "generation_config.json.tmp"], tmp_path / "s")
    HFAdapter.write_extras(None, str(out), None, ModelConfig(name="hf", path=str(source)))
    _untouched(planted)
    _replaced(out, planted, temporaries=["generation_config.json.tmp"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == {"name": name}


def test_plan_json_replaces_a_planted_link(tmp_path):
    run = tmp_path / "run"
    planted = _plant(run, ["plan.json", "plan.json.tmp"], tmp_path / "secrets")
    out = run_main(["stage=plan", "model=debug", "data=synthetic", f"hydra.run.dir={run}"], tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _untouched(planted)
    _replaced(run, planted, temporaries=["plan.json.tmp"])
    assert json.loads((run / "plan.json").read_text())["params"] > 0


def test_prepared_data_and_a_trained_tokenizer_replace_planted_links(tmp_path):
    """Data preparation (as stage=data_preparation calls it): the tokenizer it trains and the
    .bin/.idx it writes, links planted at their temporary names (named by the job's pid) and final names."""
    from framework.data.prepare import prepare
    from framework.data.tokenizer import BPETokenizer

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(a):\n    return a + {i}\n"}) + "\n" for i in range(80)))
    pid = os.getpid()
    names = [
        "c.bin",
        "c.idx",
        "c.tokenizer.json",
        f"c.tmp-{pid}.bin",
        f"c.tmp-{pid}.idx",
        f"c.tokenizer.json.tmp-{pid}",
    ]
    planted = _plant(tmp_path / "out", names, tmp_path / "secrets")
    prepare([str(corpus)], str(tmp_path / "out" / "c"), vocab_size=300, progress=False)
    _untouched(planted)
    _replaced(tmp_path / "out", planted, temporaries=[n for n in names if ".tmp-" in n])
    assert BPETokenizer(str(tmp_path / "out" / "c.tokenizer.json")).vocab_size == 300


# [Note: a directory link is followed only if it is yours] (framework/fileio.py): a link at
# `checkpoints/` or `eval/` is followed when the link and its directory are the user's (a user's way
# to put checkpoints on a big disk), and refused otherwise, before any rank starts.
OTHER_UID = 65534  # nobody: a user other than the one running the tests


def _needs_root() -> None:
    import pytest

    if os.getuid() != 0:
        reason = "planting a link owned by another user needs root (os.lchown to uid 65534); CI runs as root"
        print(reason)
        pytest.skip(reason)


def _foreign_link(link: Path, target: Path, link_uid: int, target_uid: int) -> None:
    """`link` -> `target` (a directory holding a `latest` and a results file), the link owned by
    `link_uid` and the directory by `target_uid`."""
    target.mkdir(parents=True)
    (target / "latest").write_bytes(SECRET)
    (target / "results_step_00000002.json").write_bytes(SECRET)
    os.chown(target, target_uid, target_uid)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)
    os.lchown(link, link_uid, link_uid)


def _refused_before_ranks(out, link: Path, target: Path) -> None:
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and str(link) in errors[0] and "remove the link" in errors[0], out.stderr[-3000:]
    assert str(target) not in errors[0]  # what the link names is someone else's text: not printed
    assert "rank(s) of" not in out.stderr and "Traceback" not in out.stderr  # no rank started
    assert sorted(os.listdir(target)) == ["latest", "results_step_00000002.json"]  # no step directory made
    assert (target / "latest").read_bytes() == SECRET
    assert (target / "results_step_00000002.json").read_bytes() == SECRET


def test_a_checkpoints_link_of_another_user_is_refused(tmp_path):
    _needs_root()
    run = tmp_path / "run"
    job = [*TINY, "trainer.max_steps=2", "checkpoint.interval=1", "cluster.nproc_per_node=1"]
    for name, link_uid, target_uid in (("link", OTHER_UID, 0), ("target", 0, OTHER_UID)):
        link, target = run / "checkpoints", tmp_path / f"{name}-owned-by-another"
        _foreign_link(link, target, link_uid, target_uid)
        out = run_main([*job, f"hydra.run.dir={run}"], tmp_path)
        _refused_before_ranks(out, link, target)
        link.unlink()
    # an absolute checkpoint.dir that is another user's link is refused the same way
    link, target = tmp_path / "elsewhere", tmp_path / "abs-owned-by-another"
    _foreign_link(link, target, OTHER_UID, 0)
    out = run_main([*job, f"hydra.run.dir={run}", f"checkpoint.dir={link}"], tmp_path)
    _refused_before_ranks(out, link, target)


def test_an_eval_link_of_another_user_is_refused(tmp_path):
    _needs_root()
    from conftest import pinned_import

    pinned_import("lm_eval")
    run = tmp_path / "run"
    link, target = run / "eval", tmp_path / "owned-by-another"
    _foreign_link(link, target, OTHER_UID, 0)
    job = [*TINY, "data=stdlib", "trainer.eval_tasks=[arc_easy]", "trainer.max_steps=2", f"hydra.run.dir={run}"]
    out = run_main([*job, "cluster.nproc_per_node=1"], tmp_path)
    _refused_before_ranks(out, link, target)


def test_the_users_own_checkpoints_link_is_followed(tmp_path):
    """Checkpoints on another disk through a link the user made: the job writes there and resumes."""
    run, big_disk = tmp_path / "run", tmp_path / "big_disk" / "checkpoints"
    big_disk.mkdir(parents=True)
    run.mkdir()
    (run / "checkpoints").symlink_to(big_disk, target_is_directory=True)
    job = [*TINY, "checkpoint.interval=1", "cluster.nproc_per_node=1", f"hydra.run.dir={run}"]
    out = run_main([*job, "trainer.max_steps=2"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "checkpoints").is_symlink()
    assert (big_disk / "latest").read_text().strip() == "step_00000002"
    assert (big_disk / "step_00000002").is_dir()
    out = run_main([*job, "trainer.max_steps=3", "checkpoint.resume=auto"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (big_disk / "latest").read_text().strip() == "step_00000003"


def test_directory_links_are_judged_by_their_owners(tmp_path):
    from framework.fileio import PlantedFileError, directory_link_problem, users_directory

    own = tmp_path / "own"
    own.mkdir()
    (tmp_path / "mine").symlink_to(own)
    assert directory_link_problem(str(tmp_path / "mine"), "f") is None
    assert users_directory(str(tmp_path / "mine"), "f") == str(tmp_path / "mine")
    assert directory_link_problem(str(tmp_path / "missing"), "f") is None  # made by the job
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    assert "a link to no directory" in directory_link_problem(str(tmp_path / "dangling"), "f")
    (tmp_path / "file").write_text("x")
    (tmp_path / "to_file").symlink_to(tmp_path / "file")
    try:
        users_directory(str(tmp_path / "to_file"), "checkpoint.dir=x")
        raise AssertionError("a link to a file was followed")
    except PlantedFileError as exc:
        assert str(exc).startswith(f"checkpoint.dir=x: {tmp_path / 'to_file'} is a link to no directory")
