"""Task files that name code ([Note: task files that run code] in framework/task_files.py). A task
YAML in evaluate.include_path, or a file it includes, that names Python (`!function`), a metric
Hugging Face `evaluate` would load from a script, or a Jinja template reaching Python's internals,
is refused before any rank starts, in one line naming the file and evaluate.trust_task_code, and
the code never ran (each payload would create a marker file); with the opt-in, it runs.

The job tests run one training step on local data and the task at its end (trainer.eval_tasks);
the rest call the checks `main.py` runs (framework/preflight.py) and lm-eval's own template
rendering directly."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import TINY, pinned_import, run_main

pinned_import("lm_eval")
pinned_import("datasets")

WORDS = "every rank reads the same task file and none of them runs its code".split()

TASK = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{text}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: {metric}
"""


def _task(folder: Path, name: str, data: Path, text="{{context}}", metric="acc", extra="") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(TASK.format(name=name, data=data, text=text, metric=metric) + extra)
    return path


def _payload(folder: Path, marker: Path) -> None:
    """The module `evil` beside the task files: importing it, or calling its process_docs, creates
    `marker`."""
    (folder / "evil").with_suffix(".py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\n\n"
        f"def process_docs(dataset):\n    Path({str(marker)!r}).touch()\n    return dataset\n"
    )


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("task_code")
    rnd = random.Random(0)
    docs = [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(10, 40))) for _ in range(200)]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    train_bpe(docs, 300, str(root / "tok.json"))
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(4):
            words = " ".join(rnd.choice(WORDS) for _ in range(5))
            f.write(json.dumps({"context": words, "choices": [" rank", " zq"], "label": 0}) + "\n")
    return root


def _job(root: Path, tasks: Path, run: Path, *extra: str) -> list:
    return [
        *TINY,
        "data=hf",
        f"data.paths=[{root}/corpus.parquet]",
        f"data.tokenizer={root}/tok.json",
        f"data.cache_dir={root}/cache",
        "data.seq_len=32",
        "trainer.max_steps=1",
        "cluster.nproc_per_node=1",
        f"evaluate.include_path={tasks}",
        "trainer.eval_tasks=[code_task]",
        f"hydra.run.dir={run}",
        *extra,
    ]


def test_a_function_in_a_task_file_is_refused_and_never_runs_unless_trusted(workspace, tmp_path):
    tasks, marker = tmp_path / "tasks", tmp_path / "ran"
    tasks.mkdir()
    path = _task(tasks, "code_task", workspace / "docs.jsonl", extra="process_docs: !function evil.process_docs\n")
    _payload(tasks, marker)

    out = run_main(_job(workspace, tasks, tmp_path / "refused"), tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and str(path) in errors[0] and "evaluate.trust_task_code=true" in errors[0], errors
    assert "!function evil.process_docs" in errors[0]
    assert not marker.exists()  # neither imported nor called
    assert not (tmp_path / "refused").exists()  # refused before any rank started

    # the opt-in runs it: the payload above is real, and so is the refusal's reason
    out = run_main(_job(workspace, tasks, tmp_path / "trusted", "evaluate.trust_task_code=true"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.exists()


def test_a_template_reaching_python_is_refused_and_never_renders(workspace, tmp_path):
    tasks, marker = tmp_path / "tasks", tmp_path / "ran"
    tasks.mkdir()
    payload = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    path = _task(tasks, "code_task", workspace / "docs.jsonl", text=payload)
    out = run_main(_job(workspace, tasks, tmp_path / "run"), tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and str(path) in errors[0] and "evaluate.trust_task_code=true" in errors[0], errors
    assert "a Jinja template reaching .__" in errors[0]
    assert not marker.exists()


def test_a_template_that_computes_its_way_out_is_stopped_in_the_ranks(workspace, tmp_path):
    """A name built while rendering passes the reading of the file; the sandbox stops it in the
    ranks, one line, and the payload never ran."""
    tasks, marker = tmp_path / "tasks", tmp_path / "ran"
    tasks.mkdir()
    u = "'_' ~ '_'"
    payload = f"{{{{ cycler[{u} ~ 'init' ~ {u}][{u} ~ 'globals' ~ {u}]['os'].system('touch {marker}') }}}}"
    _task(tasks, "code_task", workspace / "docs.jsonl", text=payload.replace('"', '\\"'))
    out = run_main(_job(workspace, tasks, tmp_path / "run"), tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and "sandbox" in errors[0] and "evaluate.trust_task_code=true" in errors[0], errors
    assert "Traceback" not in out.stderr
    assert not marker.exists()


def _refusal(tasks: Path):
    from framework.task_files import code_problem

    return code_problem(str(tasks))


def test_code_in_an_included_file_outside_the_include_path_is_refused_naming_that_file(workspace, tmp_path):
    tasks, shared = tmp_path / "tasks", tmp_path / "shared"
    tasks.mkdir()
    shared.mkdir()
    (shared / "base.yaml").write_text("process_docs: !function evil.process_docs\n")
    _task(tasks, "code_task", workspace / "docs.jsonl", extra="include: ../shared/base.yaml\n")
    line = _refusal(tasks)
    assert line and str(shared / "base.yaml") in line and "evaluate.trust_task_code=true" in line


def test_an_include_of_lm_evals_own_task_files_is_lm_evals_code(workspace, tmp_path):
    """lm-eval's installed task files name its own Python (hellaswag's utils module): trusted as
    the package is, even through an include."""
    from framework.task_files import lm_eval_tasks_dir

    hellaswag = Path(lm_eval_tasks_dir()) / "hellaswag" / "hellaswag.yaml"
    assert "!function" in hellaswag.read_text()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mine.yaml").write_text(f"include: {hellaswag}\ntask: my_hellaswag\n")
    assert _refusal(tasks) is None


@pytest.mark.parametrize(
    "metric, needle",
    [("./my_metric", "metric ./my_metric"), ("acc\n    hf_evaluate: true", "hf_evaluate: true")],
    ids=["a metric script", "hf_evaluate"],
)
def test_a_metric_loaded_through_hugging_face_evaluate_is_refused(workspace, tmp_path, metric, needle):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    path = _task(tasks, "code_task", workspace / "docs.jsonl", metric=metric)
    line = _refusal(tasks)
    assert line and str(path) in line and needle in line


@pytest.mark.parametrize(
    "template",
    [
        "{{ context.__class__ }}",
        "{{ context['__class__'] }}",
        "{{ context|attr('__class__') }}",
        "{{ '{0.__class__}'.format(context) }}",
        "{{ cycler.mro() }}",
    ],
)
def test_templates_that_spell_out_pythons_internals_are_refused(workspace, tmp_path, template):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    path = _task(tasks, "code_task", workspace / "docs.jsonl", text=template)
    line = _refusal(tasks)
    assert line and str(path) in line


def test_plain_task_files_pass(workspace, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task(tasks, "plain", workspace / "docs.jsonl", text="Q: {{context.split(' ')[0]|upper}} {{choices[label]}}")
    assert _refusal(tasks) is None


def test_a_key_computed_at_run_time_is_stopped_by_the_sandbox(tmp_path):
    """What no reading of the file can see: the name is built while rendering. lm-eval's own
    renderer, inside our evaluation's sandbox, refuses it; outside, it runs."""
    from jinja2.exceptions import SecurityError
    from lm_eval.utils import apply_template

    from framework.downstream import _sandboxed_templates

    marker = tmp_path / "ran"
    u = "'_' ~ '_'"
    template = f"{{{{ cycler[{u} ~ 'init' ~ {u}][{u} ~ 'globals' ~ {u}]['os'].system('touch {marker}') }}}}"
    from framework.task_files import unsafe_template

    assert unsafe_template(template) is None  # nothing to see in the text
    with _sandboxed_templates(trusted=False), pytest.raises(SecurityError):
        apply_template(template, {})
    assert not marker.exists()
    with _sandboxed_templates(trusted=True):
        apply_template(template, {})
    assert marker.exists()


def test_only_the_tasks_whose_files_name_code_are_refused(workspace, tmp_path):
    """A folder with a task file that names code beside plain ones: a job asking for the plain task
    (or a group or tag of plain tasks) runs it, and the code never runs; asking for the code task,
    directly or through a group or tag, is refused naming its file."""
    from framework.task_files import code_problem

    tasks, marker = tmp_path / "tasks", tmp_path / "ran"
    tasks.mkdir()
    code = _task(
        tasks, "code_task", workspace / "docs.jsonl", extra="tag: code_tag\nprocess_docs: !function evil.process_docs\n"
    )
    _task(tasks, "plain_task", workspace / "docs.jsonl", extra="tag: plain_tag\n")
    _payload(tasks, marker)
    (tasks / "plain_group.yaml").write_text("group: plain_group\ntask:\n  - plain_task\n")
    (tasks / "code_group.yaml").write_text("group: code_group\ntask:\n  - plain_task\n  - code_task\n")
    for plain in ("plain_task", "plain_group", "plain_tag"):
        assert code_problem(str(tasks), [plain]) is None, plain
    for refused in ("code_task", "code_group", "code_tag"):
        line = code_problem(str(tasks), ["plain_task", refused])
        assert line and str(code) in line and "evaluate.trust_task_code=true" in line, refused

    out = run_main(_job(workspace, tasks, tmp_path / "plain", "trainer.eval_tasks=[plain_task]"), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "plain" / "eval" / "results_step_00000001.json").read_text())
    assert list(results["results"]) == ["plain_task"]
    assert not marker.exists()
    out = run_main(_job(workspace, tasks, tmp_path / "code", "trainer.eval_tasks=[plain_task,code_task]"), tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and str(code) in errors[0], out.stderr[-3000:]
    assert not marker.exists() and not (tmp_path / "code").exists()  # refused before any rank started
