"""The README and docs/ say only what the code does.

- every `python main.py ...` command shown composes and passes validation (the same checks `main.py`
  runs before any rank starts), except that files a command names which a reader must bring
  (their own dataset, checkpoint or model directory) may be missing;
- every `$ python main.py ...` example followed by `error:` lines prints exactly those lines (a real
  run, exit status 2);
- every launcher command shown renders its job with `dry_run=true`;
- every repository path named in the docs, or in a comment or docstring of the code, exists, and
  every `[Note: ...]` referred to is written somewhere.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest
from conftest import REPO, run_main

DOC_FILES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "bench").glob("*.md")])
CODE_DIRS = ["framework", "launcher_scripts", "bench", "tests", "conf"]
# A command's placeholder (`<dir>`) or elision (`...`) means "fill in your own": it is not run.
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.")
# Validation problems about a path the reader brings (a dataset, a checkpoint, a model directory).
BRING_YOUR_OWN = re.compile(r"no such (file|checkpoint|directory)|does not exist|not found|no dataset|needs data.paths")


def _blocks(path: Path) -> Iterator[List[str]]:
    """The lines of every fenced code block of a Markdown file."""
    block: List[str] = []
    inside = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            if inside:
                yield block
            inside, block = not inside, []
        elif inside:
            block.append(line)


def _commands(lines: List[str]) -> Iterator[Tuple[str, List[str]]]:
    """(command, the `error:` lines that follow it) for every command of a block, with
    continuation lines joined and trailing comments dropped."""
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if line.startswith("$ "):
            line = line[2:]
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        errors = []
        while i < len(lines) and lines[i].startswith("error:"):
            errors.append(lines[i])
            i += 1
        if line:
            yield line, errors


def _doc_commands(script: str) -> List[Tuple[str, str, List[str]]]:
    found = []
    for path in DOC_FILES:
        for block in _blocks(path):
            for cmd, errors in _commands(block):
                words = cmd.split()
                for k, word in enumerate(words[:3]):
                    launcher = word.endswith("launcher_scripts/main.py") and script == "main.py"
                    if word.endswith(script) and k > 0 and "python" in words[k - 1] and not launcher:
                        found.append((str(path.relative_to(REPO)), " ".join(words[k + 1 :]), errors))
                        break
    return found


MAIN_COMMANDS = _doc_commands("main.py")
MAIN_COMMANDS = [c for c in MAIN_COMMANDS if not c[1].startswith(("-m ",))]  # sweeps: covered by tests
LAUNCHER = [c for c in _doc_commands("launcher_scripts/main.py")]
MAIN_ONLY = [c for c in MAIN_COMMANDS if "launcher_scripts" not in c[1]]


def test_docs_show_commands():
    # The parser finds what a reader sees: guards against a block format the parser would skip.
    assert len(MAIN_ONLY) >= 5, MAIN_ONLY
    assert any(errors for _, _, errors in MAIN_ONLY), "README shows an error example"


def _overrides(args: str) -> List[str]:
    """The overrides of a command line, without Hydra's own flags (`--cfg job`, `--help`)."""
    words, out = shlex.split(args), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in {"--cfg", "-c", "--package", "-p"}:
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


@pytest.mark.parametrize(
    "where, args, errors", [c for c in MAIN_ONLY if not c[2]], ids=lambda v: v if isinstance(v, str) else None
)
def test_main_command_in_docs_is_a_valid_job(tmp_path, where, args, errors):
    if PLACEHOLDER.search(args):
        pytest.skip("a placeholder the reader fills in")
    if "--help" in args:
        return  # covered by tests/integration (and always valid)
    if "stage=plan" in args:  # the planner allocates nothing: run it as shown (a few seconds)
        out = run_main(shlex.split(args) + [f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120)
        assert out.returncode == 0, f"{where}: `python main.py {args}`:\n{out.stdout}\n{out.stderr}"
        assert (tmp_path / "run" / "plan.json").exists()
        return
    from framework.config import compose_config, to_config, validate

    try:
        cfg = to_config(compose_config(_overrides(args)))
    except ValueError as exc:  # a refusal while building the typed config
        pytest.fail(f"{where}: `python main.py {args}` is refused: {exc}")
    problems = [p for p in validate(cfg) if not BRING_YOUR_OWN.search(p)]
    assert not problems, f"{where}: `python main.py {args}` is refused: {problems}"


@pytest.mark.parametrize(
    "where, args, errors", [c for c in MAIN_ONLY if c[2]], ids=lambda v: v if isinstance(v, str) else None
)
def test_error_example_in_docs_is_what_main_prints(tmp_path, where, args, errors):
    out = run_main(shlex.split(args) + [f"hydra.run.dir={tmp_path}/run"], tmp_path, timeout=120)
    printed = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, (where, out.stdout, out.stderr)
    assert printed == errors, f"{where}: the docs show {errors}, main.py prints {printed}"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("where, args, errors", LAUNCHER, ids=lambda v: v if isinstance(v, str) else None)
def test_launcher_command_in_docs_renders(tmp_path, where, args, errors):
    if PLACEHOLDER.search(args) or not args or args.split()[0] in {"status", "logs", "cancel"}:
        pytest.skip("a placeholder the reader fills in, or a command on an existing job")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        str(REPO / "launcher_scripts" / "main.py"),
        *shlex.split(args),
        "dry_run=true",
        f"cluster.jobs_dir={tmp_path}/jobs",
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if errors:
        printed = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert out.returncode == 2 and printed == errors, (where, out.stderr)
        return
    assert out.returncode == 0, f"{where}: `launcher_scripts/main.py {args}`:\n{out.stdout}\n{out.stderr}"


# Paths inside the repository, as the docs and comments write them.
PATH = re.compile(r"(?<![\w./-])((?:framework|launcher_scripts|tests|bench|conf|docs)/[\w./*-]*[\w*])")


def _texts() -> Iterator[Tuple[str, str]]:
    for path in DOC_FILES:
        yield str(path.relative_to(REPO)), path.read_text()
    for top in CODE_DIRS:
        for path in sorted((REPO / top).rglob("*")):
            if (
                path.suffix in {".py", ".yaml", ".sh", ".md"}
                and "golden" not in path.parts
                and path.name != Path(__file__).name
            ):
                yield str(path.relative_to(REPO)), path.read_text()
    for name in ["main.py", "Makefile", "Dockerfile", "pyproject.toml", ".ci/run"]:
        yield name, (REPO / name).read_text()


# Outputs a benchmark writes when it runs (its `--out` defaults), not files of the repository.
GENERATED = re.compile(r"^bench/.*\.(json|png|txt)$")


def _exists(ref: str) -> bool:
    ref = ref.rstrip(".")
    if GENERATED.match(ref):
        return True
    if "*" in ref:
        return any(REPO.glob(ref))
    return (REPO / ref).exists()


def _is_path(where: str, ref: str) -> bool:
    """In code, a string such as a store key (`framework/heartbeat`) looks like a path: there,
    only names with a file suffix or a trailing slash are taken as paths."""
    return where.endswith(".md") or ref.endswith("/") or bool(re.search(r"\.[a-z]{1,8}$", ref))


def test_every_path_named_in_docs_and_comments_exists():
    missing = sorted(
        {
            f"{where}: {ref}"
            for where, text in _texts()
            for ref in PATH.findall(text)
            if _is_path(where, ref) and not _exists(ref) and "tmp" not in ref
        }
    )
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


# A file named without its folder ("see state.py", "ENGINE_NOTES.md"): some file of the
# repository must have that name.
BARE = re.compile(r"(?<![\w./-])([A-Za-z_][\w-]*\.(?:py|md|sh))\b")


# Files of another project, named on purpose: PyTorch's own FSDP2 test files, which
# bench/upstream_fsdp2/run.py reads from a folder the user gives (nothing of them is stored here),
# and the stand-ins tests write into a temporary folder.
ELSEWHERE = re.compile(r"test_fully_shard_\w+\.py")
WRITTEN_BY = {"tests/bench/test_upstream_fsdp2_runner.py", "tests/unit/test_module_state.py"}


def test_every_bare_file_name_in_docs_and_comments_exists():
    names = {p.name for p in REPO.rglob("*") if not {".venv", ".git"} & set(p.parts)}
    missing = sorted(
        {
            f"{where}: {ref}"
            for where, text in _texts()
            for ref in BARE.findall(text)
            if ref not in names and not ELSEWHERE.fullmatch(ref) and where not in WRITTEN_BY
        }
    )
    assert not missing, "files named that exist nowhere in the repository:\n" + "\n".join(missing)


NOTE = re.compile(r"\[Note: ([^\]]+)\]")
NOTE_HEADER = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]")


def test_every_note_referred_to_is_written():
    written, referred = set(), set()
    for where, text in _texts():
        for line in text.splitlines():
            header = NOTE_HEADER.match(line)
            if header and (where.endswith(".py") or where.endswith(".sh")):
                written.add(header.group(1))
            referred.update(NOTE.findall(line))
    referred.discard("...")  # the docs' way of saying "a note"
    assert referred - written == set(), f"notes referred to but written nowhere: {referred - written}"


# ---------------------------------------------------------------- bench command lines
# A benchmark command shown in the docs (fenced or inline) takes the flags it shows: each is
# parsed by the script's own argument parser, which stops there (nothing is measured).
BENCH_CALL = re.compile(r"bench/(\w+)\.py((?:\s+[^\s`|#)]+)*)")


def _bench_commands() -> List[Tuple[str, str, str]]:
    found = set()
    for path in DOC_FILES:
        text = path.read_text()
        spans = ["\n".join(block) for block in _blocks(path)]
        prose = re.sub(r"```.*?```", " ", text, flags=re.S)
        spans += [m.group(1).replace("\n", " ") for m in re.finditer(r"`([^`]+)`", prose)]
        for span in spans:
            for line in span.splitlines():
                line = line.split("#")[0]
                for m in BENCH_CALL.finditer(line):
                    args = m.group(2).strip()
                    if PLACEHOLDER.search(args) or (args and not args.startswith("-")):
                        continue
                    source = REPO / "bench" / f"{m.group(1)}.py"
                    if not args and (not source.exists() or "ArgumentParser(" not in source.read_text()):
                        continue  # a module named, not a command (bench/common.py)
                    found.add((str(path.relative_to(REPO)), m.group(1), args))
    return sorted(found)


BENCH_COMMANDS = _bench_commands()


class _Parsed(Exception):
    pass


def test_docs_show_bench_commands():
    assert sum(1 for _, script, _ in BENCH_COMMANDS if script == "engine") >= 3, BENCH_COMMANDS


def _parse_bench(monkeypatch, capsys, where: str, script: str, args: str):
    """The namespace `bench/<script>.py <args>` parses to; the script stops there."""
    import argparse
    import runpy

    def parse_only(self, argv=None, namespace=None):
        ns, extra = self.parse_known_args(argv, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        raise _Parsed(ns)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [f"bench/{script}.py", *shlex.split(args)])
    with pytest.raises(_Parsed) as parsed:
        try:
            runpy.run_path(str(REPO / "bench" / f"{script}.py"), run_name="__main__")
        except SystemExit as e:
            pytest.fail(f"{where}: `bench/{script}.py {args}`: {capsys.readouterr().err.strip()} (exit {e.code})")
    return parsed.value.args[0]


@pytest.mark.parametrize("where, script, args", BENCH_COMMANDS, ids=lambda v: v if isinstance(v, str) else None)
def test_bench_command_in_docs_parses(monkeypatch, capsys, where, script, args):
    _parse_bench(monkeypatch, capsys, where, script, args)


def test_bench_defaults_in_docs_are_the_scripts(monkeypatch, capsys):
    # "`--timing-runs` ... default 3" in the engine page and the bench README
    defaults = _parse_bench(monkeypatch, capsys, "defaults", "engine", "")
    for path in (REPO / "docs" / "engine.md", REPO / "bench" / "README.md"):
        said = re.findall(r"`--timing-runs`[^.;]*?default (\d+)", " ".join(path.read_text().split()))
        assert said, f"{path.name} no longer states --timing-runs' default"
        assert {int(n) for n in said} == {defaults.timing_runs}, (path.name, said, defaults.timing_runs)


# ---------------------------------------------------------------- figures and their committed outputs
# A measured figure in the docs names the committed output it was read from, and is that output's:
# the GPU runs (docs/features.md, bench/RESULTS.md), the engine tables and re-check (bench/RESULTS.md) and the
# digits recipe (docs/fine_tuning.md). A run whose output was not kept has no figures in the docs.
OUTPUT = re.compile(r"`(bench/[\w./-]+\.(?:json|txt))`")


def _tables(path: Path, header: str) -> Iterator[Tuple[str, List[List[str]]]]:
    """(the text since the previous table or heading, the rows' cells) of every Markdown table of
    `path` whose header line starts with `header`."""
    lines = path.read_text().splitlines()
    preface: List[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip().replace("**", "") for c in lines[i].strip().strip("|").split("|")])
                i += 1
            if line.startswith(header):
                yield " ".join(preface), rows[2:]
            preface = []
            continue
        preface = [] if line.startswith("#") else preface + [line]
        i += 1


def _named_output(preface: str, where: str, suffix: str = "") -> Path:
    named = [name for name in OUTPUT.findall(preface) if name.endswith(suffix)]
    assert named, f"{where}: measured figures that name no committed output"
    path = REPO / named[-1]
    assert path.is_file(), f"{where}: {named[-1]} is not committed"
    return path


def _gpu_run(path: Path) -> dict:
    """One `bench/engine.py --device cuda` run, ours against FSDP2: from the script's JSON or from
    the report of `bench/gpu_check.sh` (whose ratios are printed from the unrounded times)."""
    if path.suffix == ".json":
        ours, fsdp2 = (json.loads(path.read_text())["rows"][k] for k in ("ours", "fsdp2"))
        return {
            "ours_s": ours["median_step_s"],
            "fsdp2_s": fsdp2["median_step_s"],
            "ratio": ours["median_step_s"] / fsdp2["median_step_s"],
            "ours_gib": ours["peak_mem_gib"],
            "fsdp2_gib": fsdp2["peak_mem_gib"],
            "peak_ratio": ours["peak_mem_gib"] / fsdp2["peak_mem_gib"],
        }
    text = path.read_text()
    run = {}
    for engine in ("ours", "fsdp2"):
        m = re.search(rf"^{engine}\s+step ([\d.]+) s .*peak memory ([\d.]+) GiB", text, re.M)
        run[f"{engine}_s"], run[f"{engine}_gib"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"ours / fsdp2: step time ([\d.]+)x, peak memory ([\d.]+)x", text)
    run["ratio"], run["peak_ratio"] = float(m.group(1)), float(m.group(2))
    return run


def test_gpu_table_rows_are_their_committed_outputs():
    rows = [row for _, table in _tables(REPO / "bench" / "RESULTS.md", "| run (commit) | output |") for row in table]
    assert rows, "bench/RESULTS.md no longer has its GPU table"
    for run, output, *figures in rows:
        path = _named_output(output, f"bench/RESULTS.md, GPU run {run}")
        r = _gpu_run(path)
        expected = [f"{r['ours_s']:.4f}", f"{r['fsdp2_s']:.4f}", f"{r['ratio']:.2f}"]
        expected += [f"{r['ours_gib']:.2f}", f"{r['fsdp2_gib']:.2f}", f"{r['peak_ratio']:.3f}"]
        assert figures == expected, f"bench/RESULTS.md, GPU run {run}: {figures}, but {path.name} says {expected}"


def test_readme_front_page_is_short_and_starts_with_the_two_commands():
    """The README stays a front page (at most 220 lines): the two commands first, the feature list
    and the long sections in docs/, each linked from it."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move a long section to docs/"
    first = "\n".join(lines[:15])
    assert "make run" in first and "make test" in first, first
    linked = set(re.findall(r"\]\((docs/[\w_]+\.md)\)", text))
    assert linked == {str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")}, linked


def test_feature_list_gpu_figures_are_their_committed_outputs():
    """The GPU figures of the feature list (docs/features.md, linked from the README's front page)."""
    text = (REPO / "docs" / "features.md").read_text()
    bullet = " ".join(re.search(r"^- \*\*GPUs\.\*\*.*?(?=^- |^$|\Z)", text, re.M | re.S).group(0).split())
    named = OUTPUT.findall(bullet)
    assert named, "docs/features.md's GPU figures name no committed output"
    said = set()
    for name in named:
        r = _gpu_run(REPO / name)
        said |= {f"{r['ratio']:.2f}x", f"{r['ratio']:.3f}x", f"{r['ours_gib']:.2f} GiB", f"{r['fsdp2_gib']:.2f} GiB"}
    figures = re.findall(r"\d+\.\d+x|\d+\.\d+ GiB", bullet)
    assert figures and set(figures) <= said, f"GPU figures {figures}; {', '.join(named)} say {sorted(said)}"


ENGINE_ROWS = {
    "ours (ZeRO-3)": "ours",
    "torch FSDP2": "fsdp2",
    "torch DDP": "ddp",
    "ours over gloo": "ours_gloo",
    "ours, whole rows": "ours_rows",  # --boundary-rows
    "ours, whole parameters": "ours_params",
    "ours, trainer step": "ours_clip",  # --deterministic
    "ours, trainer step, deterministic": "ours_det",
}
# bench/engine.py's JSON row fields, in the table's column order, with the digits the table shows
ENGINE_COLUMNS = [
    ("median_step_s", 3),
    ("ratio_to_fsdp2", 2),
    ("ratio_to_ddp", 2),
    ("alone_step_s", 3),
    ("alone_ratio_to_ddp", 2),
    ("tensor_bytes_mb", 1),
    ("rss_peak_mb", 0),
    ("rss_ratio_to_fsdp2", 2),
    ("comm_mb_per_step", 1),
    ("exposed_comm_s", 3),
]


@pytest.mark.parametrize("doc", ["bench/RESULTS.md", "docs/engine.md"])
def test_engine_tables_are_their_committed_outputs(doc):
    tables = list(_tables(REPO / doc, "| engine | interleaved step (s) |"))
    assert tables, f"{doc} no longer has its engine table"
    for preface, rows in tables:
        path = _named_output(preface, f"{doc}, engine table", ".json")
        measured = json.loads(path.read_text())["rows"]
        for engine, *figures in rows:
            row = measured[ENGINE_ROWS[engine]]
            expected = ["n/a" if row[k] is None else f"{row[k]:.{digits}f}" for k, digits in ENGINE_COLUMNS]
            assert figures == expected, f"{doc}, {engine}: {figures}, but {path.name} says {expected}"


def test_readme_engine_table_is_its_committed_output():
    """The README's engine table: each figure is the committed output's it names."""
    tables = list(_tables(REPO / "README.md", "| engine | step / FSDP2 |"))
    assert len(tables) == 1, "README.md has one engine table"
    preface, rows = tables[0]
    path = _named_output(preface, "README.md, engine table", ".txt").with_suffix(".json")
    measured = json.loads(path.read_text())["rows"]
    names = {"ours (default boundaries)": "ours", "torch FSDP2": "fsdp2", "torch DDP": "ddp"}
    columns = [("ratio_to_fsdp2", 2), ("ratio_to_ddp", 2), ("tensor_bytes_mb", 1), ("rss_ratio_to_fsdp2", 2)]
    columns.append(("comm_mb_per_step", 1))
    for engine, *figures in rows:
        row = measured[names[engine]]
        assert figures == [f"{row[k]:.{d}f}" for k, d in columns], (engine, figures, path.name)


def test_engine_recheck_is_its_committed_output():
    text = " ".join((REPO / "bench" / "RESULTS.md").read_text().split())
    recheck = re.search(r"Re-check .*?The guards (?:hold|do not hold)\.", text)
    assert recheck, "bench/RESULTS.md no longer has its engine re-check"
    path = _named_output(recheck.group(0), "bench/RESULTS.md, engine re-check", ".json")
    rows = json.loads(path.read_text())["rows"]
    expected = (
        f"ours {rows['ours']['median_step_s']:.3f} s, FSDP2 {rows['fsdp2']['median_step_s']:.3f} s, "
        f"DDP {rows['ddp']['median_step_s']:.3f} s: **{rows['ours']['ratio_to_fsdp2']:.2f}x** FSDP2 and "
        f"**{rows['ours']['ratio_to_ddp']:.2f}x** DDP"
    )
    assert expected in recheck.group(0), f"bench/RESULTS.md's re-check is not {path.name}'s: {expected}"


def test_digits_table_is_its_committed_output():
    path = REPO / "docs" / "fine_tuning.md"
    tables = list(_tables(path, "| step | val_loss | val_acc"))
    assert len(tables) == 1, "docs/fine_tuning.md has one digits table"
    preface, rows = tables[0]
    output = _named_output(preface, "docs/fine_tuning.md, digits table")
    log = output.read_text()
    assert rows == [list(m) for m in re.findall(r"^step (\d+): val_loss ([\d.]+), val_acc ([\d.]+)$", log, re.M)]
    took = re.search(r"took (\d+) s wall time", path.read_text()).group(1)
    assert took == re.search(r"^# wall time: (\d+) s", log, re.M).group(1)


# A test named in the docs (`tests/x/test_y.py::test_z`, `test_y.py::test_z`, then `::test_w` for
# the same file, `::test_prefix_*` for several) is defined in that file.
TEST_REF = re.compile(r"`((?:tests/[\w/]+/)?test_\w+\.py)?::(\w+)(\*?)")


def test_every_test_named_in_docs_is_in_the_file_named():
    files: dict = {}
    for p in (REPO / "tests").rglob("test_*.py"):
        files.setdefault(p.name, []).append(p)
    wrong = []
    for doc in DOC_FILES:
        for paragraph in re.split(r"\n\s*\n", doc.read_text()):
            last = None
            for m in TEST_REF.finditer(paragraph):
                last = m.group(1) or last
                name = m.group(2) + (r"\w*" if m.group(3) else r"\b")
                paths = [REPO / last] if last and "/" in last else files.get(last or "", [])
                if not any(p.is_file() and re.search(rf"^def {name}", p.read_text(), re.M) for p in paths):
                    wrong.append(f"{doc.relative_to(REPO)}: {last}::{m.group(2)}{m.group(3)}")
    assert not wrong, "tests named in the docs that their file does not define:\n" + "\n".join(wrong)
