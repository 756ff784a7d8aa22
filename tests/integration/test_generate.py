"""`stage=generate`: text from a checkpoint made on 2 ranks, loaded on 1 (DCP reshards) and on 2:
greedy decoding gives the same text on both (the sharded model computes the same logits), sampling
is seeded, and a job without prompts or weights is one refusal; several prompts give the same
texts in batches as one at a time, stop strings cut them, and generate.output_file keeps them."""

from __future__ import annotations

import itertools
import json
import os
import subprocess

import pytest
from conftest import TINY, run_main

QUIET = [a for a in TINY if not a.startswith("data=")]


def test_generate_from_a_two_rank_checkpoint_on_one_and_two_ranks(tmp_path, stdlib_cache):
    cache = stdlib_cache  # the stdlib corpus and its tokenizer
    out = run_main(
        QUIET
        + [cache, "trainer.max_steps=3", "trainer.eval_interval=0", "checkpoint.save_final=true"]
        + [f"hydra.run.dir={tmp_path}/t"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    step = tmp_path / "t" / "checkpoints" / "step_00000003"

    job_number = itertools.count()  # a run directory of its own per job

    def generate(ranks: int, *extra: str):
        return run_main(
            QUIET
            + [cache, "stage=generate", f"cluster.nproc_per_node={ranks}", f"checkpoint.resume={step}"]
            + ['generate.prompts=["def add(a, b):"]', "generate.max_new_tokens=12", *extra]
            + [f"hydra.run.dir={tmp_path}/g{ranks}-{next(job_number)}"],
            tmp_path,
        )

    one, two = generate(1, "generate.temperature=0"), generate(2, "generate.temperature=0")
    for result in (one, two):
        assert result.returncode == 0, result.stderr[-3000:]
        assert "generating from step 3" in result.stderr
    assert one.stdout.startswith("def add(a, b):") and len(one.stdout.strip()) > len("def add(a, b):")
    assert one.stdout == two.stdout  # greedy: 1 rank and 2 sharded ranks say the same
    sampled = [generate(1, "generate.seed=5").stdout for _ in range(2)]
    assert sampled[0] == sampled[1]  # seeded
    # The sampling settings reach the sampler: with the default temperature (0.8) and top_k (50)
    # the text differs from greedy's (3 steps leave the distribution wide); top_k=1, a tiny top_p
    # or a tiny temperature leave only the most likely token, so the same seed gives greedy's text.
    greedy = one.stdout
    assert sampled[0] != greedy
    for setting in ("generate.top_k=1", "generate.top_p=1e-6", "generate.temperature=1e-40"):
        narrowed = generate(1, "generate.seed=5", setting)
        assert narrowed.returncode == 0, (setting, narrowed.stderr[-3000:])
        assert narrowed.stdout == greedy, setting
    refused = run_main(
        QUIET
        + [cache, "stage=generate", "cluster.nproc_per_node=1", f"checkpoint.resume={step}"]
        + [f"hydra.run.dir={tmp_path}/r"],
        tmp_path,
    )
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "error: stage=generate needs generate.prompts=[...]" in refused.stderr
    # the prompt and its completion must fit the model's positions (model=debug: 1024), refused in one line
    long = generate(1, "generate.max_new_tokens=1020")
    assert long.returncode == 2, long.stderr[-3000:]
    errors = [line for line in long.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: generate.max_new_tokens=1020: with the longest prompt ("
    ), errors
    assert "exceeds the model's 1024 positions" in errors[0], errors


PROMPTS = ["def add(a, b):", "import os", "class Point:", "x = [", "for i in range(10):"]


@pytest.fixture(scope="module")
def generate_from(tmp_path_factory, stdlib_cache):
    """`generate(*overrides)`: stage=generate on 1 rank with PROMPTS, 16 new tokens, from a
    3-step checkpoint trained once for the module."""
    root = tmp_path_factory.mktemp("generate")
    out = run_main(
        QUIET
        + [stdlib_cache, "trainer.max_steps=3", "trainer.eval_interval=0", "checkpoint.save_final=true"]
        + [f"hydra.run.dir={root}/t"],
        root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    step = root / "t" / "checkpoints" / "step_00000003"
    job_number = itertools.count()

    def generate(*extra: str):
        return run_main(
            QUIET
            + [stdlib_cache, "stage=generate", "cluster.nproc_per_node=1", f"checkpoint.resume={step}"]
            + [f"generate.prompts={json.dumps(PROMPTS)}", "generate.max_new_tokens=16", *extra]
            + [f"hydra.run.dir={root}/g{next(job_number)}"],
            root,
        )

    return generate


def test_batches_stop_strings_and_the_output_file(tmp_path, generate_from):
    generate, prompts = generate_from, PROMPTS

    def records(path):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    # Sampled (seeded per prompt by its place in the job): batches of 2 and of all 5 give each
    # prompt the text it gets alone, streamed; the file holds what the terminal shows.
    alone, paired, all5 = (tmp_path / f"{n}.jsonl" for n in ("alone", "paired", "all5"))
    for size, path in ((1, alone), (2, paired), (5, all5)):
        result = generate("generate.seed=3", f"generate.batch_size={size}", f"generate.output_file={path}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"wrote 5 completions to {path}" in result.stderr
        shown = "".join(r["prompt"] + r["completion"] + "\n" for r in records(path))
        assert result.stdout == shown, (size, result.stdout, shown)
    assert [r["prompt"] for r in records(alone)] == prompts
    assert records(alone) == records(paired) == records(all5)
    assert all(r["finish_reason"] in ("eos", "length") and r["new_tokens"] > 0 for r in records(alone))

    # A stop string taken from the middle of the first completion ends it there (the text before
    # it kept, the string not printed, streamed or batched); the others run as before or stop too.
    first = records(alone)[0]["completion"]
    assert len(first) >= 4, first
    stop = next(first[i : i + 2] for i in range(len(first) // 2, len(first) - 1) if first[i : i + 2].strip())
    for size in (1, 5):
        path = tmp_path / f"stop{size}.jsonl"
        result = generate(
            "generate.seed=3", f"generate.batch_size={size}", f"generate.output_file={path}",
            f"generate.stop_strings={json.dumps([stop])}",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        got = records(path)
        assert got[0]["completion"] == first[: first.index(stop)] and got[0]["finish_reason"] == "stop"
        for new, old in zip(got[1:], records(alone)[1:]):
            cut = old["completion"].find(stop)
            assert new["completion"] == (old["completion"] if cut < 0 else old["completion"][:cut])
        assert result.stdout == "".join(r["prompt"] + r["completion"] + "\n" for r in got), size

    # An existing file is refused before any rank starts and left as it was, a link included.
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    os.symlink(target, tmp_path / "link.jsonl")
    for name in ("link.jsonl", "precious.txt"):
        refused = generate(f"generate.output_file={tmp_path / name}")
        assert refused.returncode == 2, refused.stderr[-3000:]
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
        assert errors == [
            f"error: generate.output_file={tmp_path / name}: exists; name a new file (completions never replace a file)"
        ], refused.stderr[-3000:]
        assert "generating from" not in refused.stderr  # no rank started
    assert target.read_text() == "keep me"
    refused = generate("generate.batch_size=0")
    assert refused.returncode == 2 and "error: generate.batch_size=0: must be > 0 and finite" in refused.stderr


def test_an_output_file_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, generate_from):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    full = tmp_path / "full"
    full.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True, text=True
    )
    assert mounted.returncode == 0, mounted.stderr
    try:
        with open(full / "filler", "wb", buffering=0) as f:  # fill it: the completions' file finds no room
            try:
                while True:
                    f.write(b"x" * 4096)
            except OSError:
                pass
        out = generate_from("generate.temperature=0", f"generate.output_file={full}/completions.jsonl")
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: generate.output_file={full}/completions.jsonl: "), (
            errors
        )
        assert "No space left on device" in errors[0] and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert all(p in out.stdout for p in PROMPTS), out.stdout  # the completions were printed
        assert sorted(os.listdir(full)) == ["filler"]  # no partial file, no temporary
    finally:
        subprocess.run(["umount", str(full)], check=False)
