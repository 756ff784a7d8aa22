"""A training run's `config.yaml` describes that run: a later stage in its directory (generate,
evaluate, as the README runs them) writes its own `config.<stage>.yaml`, and a refused job writes
nothing there (no config, no TensorBoard events file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, run_main

TASK = """\
task: pick_word
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A training run of 2 steps on local parquet data with its tokenizer, checkpointed at the end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("run_config")
    docs = [f"def f{i}(a):\n    return a * {i} + {i % 7}\n" * 3 for i in range(300)]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    train_bpe(docs[:100], 300, str(root / "tok.json"))
    (root / "tasks").mkdir()
    with open(root / "pick_word.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"context": f"def f{i}(a):", "choices": [" return", " zq", " vv"], "label": 0}) + "\n")
    (root / "tasks" / "pick_word.yaml").write_text(TASK.format(data=root / "pick_word.jsonl"))
    out = run_main(
        _common(root) + ["trainer.max_steps=2", "trainer.eval_interval=0", "checkpoint.save_final=true"],
        root,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return root


def _common(root: Path) -> list:
    return TINY + [
        "data=hf",
        f"data.paths=[{root}/corpus.parquet]",
        f"data.tokenizer={root}/tok.json",
        f"data.cache_dir={root}/cache",
        "data.seq_len=32",
        "cluster.nproc_per_node=1",
        f"evaluate.include_path={root}/tasks",
        f"hydra.run.dir={root}/run",
    ]


def _files(run: Path) -> dict:
    """Every file of the run directory and its bytes (the lock file aside: each job writes its
    holder's pid there)."""
    return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}


def test_later_stages_write_their_own_config_and_refused_jobs_write_nothing(trained):
    run = trained / "run"
    config = (run / "config.yaml").read_bytes()
    assert b"stage: training" in config and b"max_steps: 2" in config

    # The README's own: stage=generate in the training run's directory, from its latest checkpoint.
    out = run_main(
        _common(trained)
        + ["stage=generate", "checkpoint.resume=auto", 'generate.prompts=["def f1(a):"]', "generate.max_new_tokens=2"],
        trained,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "config.yaml").read_bytes() == config
    assert b"stage: generate" in (run / "config.generate.yaml").read_bytes()

    out = run_main(
        _common(trained) + ["stage=evaluate", "checkpoint.resume=auto", "evaluate.tasks=[pick_word]"],
        trained,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "config.yaml").read_bytes() == config
    assert b"stage: evaluate" in (run / "config.evaluate.yaml").read_bytes()

    # Refused jobs in the same directory: nothing of the run changes, nothing is added (no
    # config of theirs, no TensorBoard events file).
    before = _files(run)
    refused = {
        # found in the rank, once the tracker (TensorBoard) is open: a directory of tasks that is not there
        "evaluate": ["stage=evaluate", "checkpoint.resume=auto", "evaluate.tasks=[pick_word]"]
        + [f"evaluate.include_path={trained}/no_tasks"],
        # found in the ranks when the job resumes: the checkpoint is of another model
        "training": ["checkpoint.resume=auto", "trainer.max_steps=4", "model.args.dim=32"],
    }
    for stage, args in refused.items():
        out = run_main(_common(trained) + ["logging.tensorboard=true", *args], trained)
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and len(errors) == 1, (stage, out.stderr[-3000:])
        after = _files(run)
        assert after.keys() == before.keys(), (stage, sorted(set(after) ^ set(before)))
        changed = [name for name in before if after[name] != before[name]]
        assert not changed, (stage, changed)
