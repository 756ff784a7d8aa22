"""lm-eval-harness on our models: tasks over local JSONL data, during training (trainer.eval_tasks)
and as `stage=evaluate` on the export of the trained model, on 1 and 2 ranks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import TINY, pinned_import, read_metrics, run_main

pinned_import("lm_eval")
pinned_import("datasets")

WORDS = "the model trains on shards of data gathered unit by unit while every rank keeps its own piece".split()

TASKS = """\
task: next_word
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATE_TASK = """\
task: continue_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("evaluate")
    rnd = random.Random(0)
    docs = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(10, 80))) for _ in range(1500)]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    train_bpe(docs[:300], 512, str(root / "tok.json"))
    tasks = root / "tasks"
    tasks.mkdir()
    with open(root / "next_word.jsonl", "w") as f:
        for _ in range(24):
            words = [rnd.choice(WORDS) for _w in range(6)]
            choices = [f" {rnd.choice(WORDS)}", " zqxj", " vvkk"]
            f.write(json.dumps({"context": " ".join(words), "choices": choices, "label": 0}) + "\n")
    with open(root / "continue_text.jsonl", "w") as f:
        for _ in range(6):
            f.write(json.dumps({"context": " ".join(rnd.choice(WORDS) for _w in range(5)), "answer": " the"}) + "\n")
    (tasks / "next_word.yaml").write_text(TASKS.format(data=root / "next_word.jsonl"))
    (tasks / "continue_text.yaml").write_text(GENERATE_TASK.format(data=root / "continue_text.jsonl"))
    return root


def _common(root: Path) -> list:
    return [
        *[a for a in TINY if not a.startswith("logging.tensorboard")],
        "data=hf",
        f"data.paths=[{root}/corpus.parquet]",
        f"data.tokenizer={root}/tok.json",
        f"data.cache_dir={root}/cache",
        "data.seq_len=64",
        f"evaluate.include_path={root}/tasks",
    ]


@pytest.fixture(scope="module")
def trained(workspace, tmp_path_factory) -> Path:
    """8 steps on 2 ranks with the local task every 4 steps, and an export at the end."""
    train_dir = tmp_path_factory.mktemp("trained") / "run"
    out = run_main(
        [*_common(workspace), "trainer.max_steps=8", "trainer.eval_interval=0", "optimizer.lr=1e-2"]
        + ["trainer.eval_tasks=[next_word]", "trainer.eval_tasks_interval=4", "checkpoint.export_safetensors=true"]
        + ["logging.tensorboard=false", f"hydra.run.dir={train_dir}"],
        train_dir.parent,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return train_dir


def test_tasks_during_training_and_on_the_export_on_one_and_two_ranks(workspace, trained, tmp_path):
    train_dir = trained
    during = {r["step"]: r["eval/next_word/acc"] for r in read_metrics(train_dir) if "eval/next_word/acc" in r}
    assert sorted(during) == [4, 8]
    assert sorted(p.name for p in (train_dir / "eval").iterdir()) == [
        "results_step_00000004.json",
        "results_step_00000008.json",
    ]
    export = train_dir / "checkpoints" / "export"
    scores = {}
    for ranks in (1, 2):
        run = tmp_path / f"eval{ranks}"
        out = run_main(
            [*_common(workspace), "stage=evaluate", f"checkpoint.init_from={export}", f"cluster.nproc_per_node={ranks}"]
            + ["evaluate.tasks=[next_word,continue_text]", f"hydra.run.dir={run}"],
            tmp_path,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        # lm-eval's own table, printed once
        assert out.stderr.count("|next_word") == 1 and "|continue_text" in out.stderr and "|acc" in out.stderr
        (results,) = (run / "eval").iterdir()
        saved = json.loads(results.read_text())["results"]
        scores[ranks] = saved
        assert 0 <= saved["next_word"]["acc"] <= 1 and 0 <= saved["continue_text"]["exact_match"] <= 1
        # and logged to the tracker (TensorBoard, the default logger)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
        acc = EventAccumulator(str(events))
        acc.Reload()
        assert acc.Scalars("eval/next_word/acc")[0].value == pytest.approx(saved["next_word"]["acc"])
    # the export is the model after step 8: the same accuracy as the in-training evaluation there,
    # and the same on 1 and 2 ranks
    assert scores[1]["next_word"]["acc"] == pytest.approx(during[8])
    assert scores[1] == scores[2]
    # a model that learned the corpus prefers its words to the made-up ones
    assert during[8] > 0.9


def test_an_unknown_task_is_one_line(workspace, trained, tmp_path):
    out = run_main(
        [*_common(workspace), "stage=evaluate", "evaluate.tasks=[no_such_task]", "cluster.nproc_per_node=1"]
        + [f"checkpoint.init_from={trained}/checkpoints/export", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "no lm-eval task no_such_task" in out.stderr and "Traceback" not in out.stderr
