"""lm-eval tasks during training (`trainer.eval_tasks`) under a pipeline and under sequence
parallelism, against one process's run on the same data (made once). Under a pipeline (pp=2) the
stages run in turn outside the schedule on lm-eval's rows (any length), the logits broadcast from
the last stage; under sequence parallelism (tp=2; inside a pipeline's stages, 4 ranks, with
COMPOSITION_ALL=1) the rows are padded to a multiple of tp. Either way the tasks' scores (a
multiple-choice task and a generation task) equal one process's on the same training.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from conftest import TINY, pinned_import, read_metrics, run_main

pinned_import("lm_eval")

# the same tasks and words as the one-process tests of lm-eval (tests/integration/test_evaluate.py)
from tests.integration.test_evaluate import GENERATE_TASK as GENERATE  # noqa: E402
from tests.integration.test_evaluate import TASKS as TASK  # noqa: E402
from tests.integration.test_evaluate import WORDS  # noqa: E402


def _workspace(root: Path) -> list:
    """The corpus, tokenizer and task files: contexts of 5 to 9 words (rows of odd and even
    lengths, which sequence parallelism cannot cut in two unpadded) and a generation task."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework.data.tokenizer import train_bpe

    rnd = random.Random(0)
    docs = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(10, 80))) for _ in range(400)]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    train_bpe(docs[:300], 512, str(root / "tok.json"))
    (root / "tasks").mkdir()
    with open(root / "next_word.jsonl", "w") as f:
        for _ in range(24):
            words = [rnd.choice(WORDS) for _w in range(rnd.randint(5, 9))]
            choices = [f" {rnd.choice(WORDS)}", f" {rnd.choice(WORDS)}", " vvkk"]
            f.write(json.dumps({"context": " ".join(words), "choices": choices, "label": 0}) + "\n")
    (root / "tasks" / "next_word.yaml").write_text(TASK.format(data=root / "next_word.jsonl"))
    with open(root / "continue_text.jsonl", "w") as f:
        for _ in range(6):
            f.write(json.dumps({"context": " ".join(rnd.choice(WORDS) for _w in range(5)), "answer": " the"}) + "\n")
    (root / "tasks" / "continue_text.yaml").write_text(GENERATE.format(data=root / "continue_text.jsonl"))
    return [
        *[a for a in TINY if a != "data=synthetic"],
        "data=hf",
        f"data.paths=[{root}/corpus.parquet]",
        f"data.tokenizer={root}/tok.json",
        f"data.cache_dir={root}/cache",
        "data.seq_len=32",
        "model.args.n_layers=4",
        f"evaluate.include_path={root}/tasks",
        "trainer.max_steps=4",
        "trainer.eval_interval=0",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8",
        "optimizer.lr=1e-2",
        "trainer.eval_tasks=[next_word,continue_text]",
    ]


LAYOUTS = {
    "1f1b": ["cluster.nproc_per_node=2", "parallelism.pp=2", "parallelism.pp_schedule=1f1b"],
    "interleaved_1f1b": ["cluster.nproc_per_node=2", "parallelism.pp=2", "parallelism.pp_schedule=interleaved_1f1b"],
    "tp2_sp": ["cluster.nproc_per_node=2", "parallelism.tp=2", "parallelism.sequence_parallel=true"],
    "pp2_tp2_sp": [  # 4 ranks: opt-in
        "cluster.nproc_per_node=4",
        "parallelism.pp=2",
        "parallelism.tp=2",
        "parallelism.sequence_parallel=true",
    ],
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> tuple:
    """The task files and one process's run on them, made once: (overrides, the reference's run dir)."""
    root = tmp_path_factory.mktemp("pipeline_eval_tasks")
    common = _workspace(root)
    run = root / "one"
    out = run_main(common + ["cluster.nproc_per_node=1", f"hydra.run.dir={run}"], root, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return common, run


def _scores(run: Path) -> dict:
    (results,) = (run / "eval").iterdir()
    return json.loads(results.read_text())["results"]


@pytest.mark.parametrize(
    "layout",
    [
        "1f1b",
        "interleaved_1f1b",
        "tp2_sp",
        pytest.param(
            "pp2_tp2_sp",
            marks=pytest.mark.skipif(os.environ.get("COMPOSITION_ALL") != "1", reason="COMPOSITION_ALL=1"),
        ),
    ],
)
def test_eval_tasks_equal_one_process(workspace, tmp_path, layout):
    common, one = workspace
    run = tmp_path / layout
    out = run_main(common + LAYOUTS[layout] + [f"hydra.run.dir={run}"], tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    mine, ref = _scores(run), _scores(one)
    # 24 questions of 3 choices each: the same log-likelihoods (1e-5 apart at most, see
    # test_pipeline.py) pick the same answers and the same greedy tokens, so the scores are equal,
    # not close; the trained model beats chance (1/3), so the answers are not all ties
    assert mine == ref and mine["next_word"]["sample_len"] == 24 and mine["next_word"]["acc"] > 0.4, (mine, ref)
    assert mine["continue_text"]["sample_len"] == 6, mine
    losses = [[r["loss"] for r in read_metrics(d) if "loss" in r] for d in (run, one)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5) and len(losses[0]) == 4
    assert [r["step"] for r in read_metrics(run) if "eval/next_word/acc" in r] == [4]
