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
