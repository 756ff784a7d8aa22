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


def test_every_bare_file_name_in_docs_and_comments_exists():
    names = {p.name for p in REPO.rglob("*") if not {".venv", ".git"} & set(p.parts)}
    missing = sorted({f"{where}: {ref}" for where, text in _texts() for ref in BARE.findall(text) if ref not in names})
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
