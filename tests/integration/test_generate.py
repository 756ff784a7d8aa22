"""`stage=generate`: text from a checkpoint made on 2 ranks, loaded on 1 (DCP reshards) and on 2:
greedy decoding gives the same text on both (the sharded model computes the same logits), sampling
is seeded, and a job without prompts or weights is one refusal."""

from __future__ import annotations

import itertools

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
