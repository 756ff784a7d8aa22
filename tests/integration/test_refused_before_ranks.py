"""What the ranks would refuse is refused before any rank starts (framework/preflight.py): an
unknown lm-eval task (it took 47 s, lm-eval indexing all its tasks in a rank), lm-eval tasks on
data without a tokenizer (found after training), an MLflow address where nothing listens (17 s of
the client's retries), a hub name in data.paths, stage=evaluate without tasks. Each is one line and
status 2 within 5 s of wall time, and no rank started: no rank printed the model line, and the run
directory a rank would have claimed does not exist."""

from __future__ import annotations

import time

import pytest
from conftest import TINY, free_port, pinned_import, run_main

pinned_import("lm_eval")

CASES = {
    "unknown task in training": (
        ["data=stdlib", "trainer.eval_tasks=[no_such_task]"],
        "trainer.eval_tasks: no lm-eval task no_such_task",
    ),
    "unknown task in evaluation": (
        ["data=stdlib", "stage=evaluate", "evaluate.tasks=[arc_easy,no_such_task]", "checkpoint.init_from={tmp}"],
        "evaluate.tasks: no lm-eval task no_such_task;",
    ),
    "tasks on data without a tokenizer": (
        ["trainer.eval_tasks=[arc_easy]"],  # TINY's data=synthetic: no text, no tokenizer
        "trainer.eval_tasks: lm-eval tasks need a tokenizer, and data=synthetic has none",
    ),
    "evaluation without tasks": (
        ["stage=evaluate", "checkpoint.init_from={tmp}"],
        "stage=evaluate needs evaluate.tasks",
    ),
    "MLflow where nothing listens": (
        ["logger=[mlflow]", "logging.mlflow.tracking_uri=http://127.0.0.1:{port}"],
        "logging.mlflow.tracking_uri=http://127.0.0.1:{port}: nothing answers",
    ),
    "hub name in data.paths": (["data=hf", "data.paths=[allenai/c4]"], "data.paths: allenai/c4: no such file"),
}


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> None:
    """The tests' fork server started (once per test process), so the wall times below are the
    jobs' own."""
    tmp = tmp_path_factory.mktemp("warm")
    assert run_main([*TINY, "trainer.max_steps=0"], tmp).returncode == 2


@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_one_line_before_any_rank_starts(warm, tmp_path, case):
    overrides, expected = CASES[case]
    port = free_port()
    overrides = [o.format(tmp=tmp_path, port=port) for o in overrides]
    run = tmp_path / "run"
    began = time.monotonic()
    args = [*TINY, *overrides, "trainer.max_steps=2", "cluster.nproc_per_node=1", f"hydra.run.dir={run}"]
    out = run_main(args, tmp_path, timeout=300)
    wall = time.monotonic() - began
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and expected.format(port=port) in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert "rank(s) of" not in out.stderr  # rank 0 prints the model line once the model is built
    assert not run.exists()  # a rank would have claimed it (lock, config)
    assert wall < 5, f"{case}: refused after {wall:.1f} s"


BROKEN = 'task: broken_task\ndataset_path: json\ndoc_to_text: "{{context}\n'  # an unclosed quote


@pytest.mark.parametrize("asked", ["broken_task", "its_group"])
def test_a_task_file_that_does_not_parse_is_named_before_any_rank_starts(warm, tmp_path, asked):
    """lm-eval's index skips a task file that does not parse; the ranks then said "no lm-eval task
    broken_task" after building the model, though the file was there."""
    tasks, run = tmp_path / "tasks", tmp_path / "run"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text(BROKEN)
    (tasks / "group.yaml").write_text("group: its_group\ntask:\n  - broken_task\n")
    began = time.monotonic()
    args = [*TINY, "data=stdlib", f"trainer.eval_tasks=[{asked}]", f"evaluate.include_path={tasks}"]
    out = run_main([*args, "trainer.max_steps=2", "cluster.nproc_per_node=1", f"hydra.run.dir={run}"], tmp_path)
    wall = time.monotonic() - began
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and f"{tasks / 'broken.yaml'} (task {asked}) cannot be read: not YAML" in errors[0], errors
    assert "line 4, column 1" in errors[0] and "fix the file" in errors[0]
    assert "rank(s) of" not in out.stderr and not run.exists()  # no rank started
    assert wall < 5, f"refused after {wall:.1f} s"


def test_an_unknown_task_names_the_local_file_that_does_not_parse(warm, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "broken.yaml").write_text("task: [broken_task\n")  # its name itself cannot be read
    args = [*TINY, "data=stdlib", "trainer.eval_tasks=[broken_task]", f"evaluate.include_path={tasks}"]
    out = run_main([*args, "cluster.nproc_per_node=1", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "no lm-eval task broken_task" in errors[0] and f"{tasks / 'broken.yaml'} cannot be read" in errors[0]


COLD = {
    "a config field": (["trainer.max_steps=-5"], "trainer.max_steps=-5: must be > 0"),
    "the family's own check": (["model.args.rope_scaling={{a: 1}}"], "model.args.rope_scaling="),
    "a model argument": (["model.args.vocab_size=0"], "model.args.vocab_size=0: must be > 0"),
    "an unknown lm-eval task": (["data=stdlib", "trainer.eval_tasks=[no_such_task]"], "no lm-eval task no_such_task"),
    "a hub name in data.paths": (["data=hf", "data.paths=[allenai/c4]"], "data.paths: allenai/c4: no such file"),
    "MLflow where nothing listens": (
        ["logger=[mlflow]", "logging.mlflow.tracking_uri=http://127.0.0.1:{port}"],
        "nothing answers",
    ),
}


@pytest.mark.parametrize("case", list(COLD))
def test_refused_by_the_real_command_line_without_importing_torch(tmp_path, case):
    """`python main.py` itself, cold (no tests' server that imported everything already): a config
    or a check before the ranks is refused without torch ([Note: no torch before the config is
    accepted] in framework/entrypoint.py), which took ~4 s of the refusal's time to import. Python's
    own import log (-X importtime) shows every module the job imported."""
    import resource
    import subprocess
    import sys

    from conftest import REPO, main_env

    overrides = [o.format(port=free_port()) for o in COLD[case][0]]
    run = tmp_path / "run"
    cmd = [sys.executable, "-X", "importtime", str(REPO / "main.py"), *TINY, *overrides, f"hydra.run.dir={run}"]
    # Once unmeasured first: on a fresh clone the first command compiles every module's bytecode
    # (a one-time cost of the install, ~1 CPU second), which is not the refusal's.
    subprocess.run(cmd, cwd=tmp_path, env=main_env(), capture_output=True, timeout=120)
    assert tmp_path.is_dir()  # the refusal removed the run directory it made, not the user's empty cwd
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, cwd=tmp_path, env=main_env(), capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and COLD[case][1] in errors[0], errors
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "framework.entrypoint" in imported  # the log is there: the job's own imports are in it
    assert "torch" not in imported, [m for m in imported if m.startswith("torch")][:5]
    assert not run.exists()
    # CPU seconds, not wall time: on a loaded 2-core machine the wall time of a 0.5 s job is
    # several times that. Measured on a quiet machine (`/usr/bin/time`, warm): 0.5 s for a config
    # field, 0.8 s for a task name (lm-eval's index of its own tasks); with torch it was ~4.4 s.
    # The bound leaves room for what the suite's load does to CPU time too (a cache shared with
    # another worker's ranks: the task name took 2.45 CPU s at load 20); the torch check above
    # is what keeps it fast.
    assert cpu < 3, f"{case}: {cpu:.2f} CPU seconds"
