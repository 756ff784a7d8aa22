"""megatron-core's index cache (`<data.cache_dir>/index/*.npy`) from a real 2-rank job, then altered:
a value out of range, or a pickle, is refused in one line with status 2 and no traceback from any
rank (see [Note: cached indices checked against their dataset] in framework/data/index_cache.py
and [Note: index caches built in turn, refusals agreed] in framework/data/indexed.py)."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import numpy
import pytest
from conftest import TINY, run_main


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A small prepared corpus and the index cache a 2-rank training job on it wrote."""
    from framework.data.prepare import prepare

    root = tmp_path_factory.mktemp("index_cache")
    corpus = root / "c.jsonl"
    lines = (json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (5 + i)}) for i in range(40))
    corpus.write_text("".join(line + "\n" for line in lines))
    prefix, _ = prepare([str(corpus)], str(root / "c"), vocab_size=300, progress=False)
    args = [a for a in TINY if not a.startswith("data=")] + [
        "data=indexed",
        f"data.paths=[{prefix}]",
        "data.seq_len=16",
        "data.split='80,20,0'",
        "cluster.nproc_per_node=2",
        "trainer.max_steps=1",
        "trainer.eval_interval=0",
    ]
    out = run_main(args + [f"data.cache_dir={root}/cache", f"hydra.run.dir={root}/run"], root)
    assert out.returncode == 0, out.stderr[-3000:]
    return {"root": root, "prefix": prefix, "args": args, "cache": root / "cache"}


def _copy_cache(job, tmp_path) -> Path:
    shutil.copytree(job["cache"], tmp_path / "cache")
    return tmp_path / "cache"


def _cached(cache: Path, name: str) -> Path:
    (found,) = sorted((cache / "index").glob(f"*-GPTDataset-train-{name}.npy"))
    return found


def _refused_in_one_line(out) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Connection closed" not in out.stderr, out.stderr[-3000:]
    return errors[0]


def test_an_out_of_range_document_index_is_refused_before_the_first_batch(job, tmp_path):
    cache = _copy_cache(job, tmp_path)
    path = _cached(cache, "document_index")
    ids = numpy.load(path)
    numpy.save(path, numpy.full_like(ids, 2**31 - 1))  # an int32 array of the right shape: megatron loads it
    out = run_main(job["args"] + [f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    error = _refused_in_one_line(out)
    assert f"{path} holds document id 2147483647, not one of the train split's 0-31" in error, error
    assert "delete it and the index is rebuilt" in error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_a_pickled_cache_refused_on_rank_0_is_the_only_line(job, tmp_path):
    cache = _copy_cache(job, tmp_path)
    path = _cached(cache, "document_index")
    path.write_bytes(pickle.dumps({"not": "an array"}))
    out = run_main(job["args"] + [f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    error = _refused_in_one_line(out)
    assert f"{path} is not an index array megatron-core wrote (it holds pickled Python objects" in error, error


def _alter(array: numpy.ndarray, case: str) -> numpy.ndarray:
    array = numpy.array(array)
    if case == "sample_offset":
        array[1, 1] = 10_000  # a token offset past its document
    elif case == "sample_position":
        array[-1, 0] = len(array) * 100  # a position past the document index
    elif case == "sample_back":
        array[2, 0], array[3, 0] = array[3, 0] + 1, 0  # goes back
    elif case == "shuffle_value":
        array[0] = len(array)  # a sample that does not exist
    elif case == "shuffle_short":
        array = array[:-1]  # fewer entries than samples: the last indices would fail
    elif case == "float":
        array = array.astype(numpy.float64)
    return array


@pytest.mark.parametrize(
    "case, name, says",
    [
        ("sample_offset", "sample_index", r"starts sample 1 at token 10000 of a document of \d+ tokens"),
        ("sample_position", "sample_index", r"points at position \d+ of a \d+-entry document index"),
        ("sample_back", "sample_index", r"goes back in the document index at sample 3"),
        ("shuffle_value", "shuffle_index", r"names sample (\d+), not one of its \1"),
        ("shuffle_short", "shuffle_index", r"has (\d+) entries for (?!\1)\d+ samples"),
        ("float", "document_index", r"holds a 1-D float64 array, not 1-D integers"),
    ],
)
def test_every_cached_array_is_held_to_its_dataset(job, tmp_path, case, name, says):
    """The same check on each array, in this process through build_indexed (what the job calls)."""
    from framework.data.indexed import build_indexed
    from framework.data.tokenizer import BPETokenizer
    from framework.errors import UserInputError

    cache = tmp_path / "cache"
    kw = dict(split="80,20,0", seq_len=16, seed=1, tokenizer=BPETokenizer(job["prefix"] + ".tokenizer.json"))
    train, _ = build_indexed([job["prefix"]], [], cache_dir=str(cache), **kw)  # written and checked
    first = train[0].tolist()
    train, _ = build_indexed([job["prefix"]], [], cache_dir=str(cache), **kw)  # a cache hit, checked: the same
    assert train[0].tolist() == first
    path = _cached(cache, name)
    numpy.save(path, _alter(numpy.load(path), case))
    with pytest.raises(UserInputError) as exc:
        build_indexed([job["prefix"]], [], cache_dir=str(cache), **kw)
    assert re.match(rf"data.cache_dir: {re.escape(str(path))} {says}: ", str(exc.value)), str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.fixture
def one_rank_group():
    """megatron-core builds blends only inside a process group (as training always runs)."""
    import torch.distributed as dist

    from framework.runtime import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_blends_cached_indices_are_held_to_its_datasets(job, tmp_path, one_rank_group):
    from framework.data.indexed import build_indexed
    from framework.data.tokenizer import BPETokenizer
    from framework.errors import UserInputError

    cache = tmp_path / "cache"
    kw = dict(split="80,20,0", seq_len=16, seed=1, tokenizer=BPETokenizer(job["prefix"] + ".tokenizer.json"))
    paths, weights = [job["prefix"], job["prefix"]], [0.5, 0.5]
    build_indexed(paths, weights, cache_dir=str(cache), **kw)
    (which,) = sorted((cache / "index").glob("*-BlendedDataset-train-dataset_index.npy"))
    numpy.save(which, numpy.full_like(numpy.load(which), 7))  # a blend of 2 has no dataset 7
    with pytest.raises(UserInputError, match=rf"{which} names dataset 7 of a blend of 2"):
        build_indexed(paths, weights, cache_dir=str(cache), **kw)
