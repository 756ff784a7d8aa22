"""Embedded fine-tuning sets cut from this Python's standard library, written once as JSONL into
the data cache (the same Python gives the same file).

`stdlib_functions`: "complete this function" pairs. For each function or method of the stdlib
modules *not* in the pre-training corpus (`framework/data/stdlib.py` takes the first ~2 MB of
modules in name order; these are the rest), the prompt is an instruction, the function's
signature and its docstring, the response the body that follows; only short functions (at most
MAX_BODY_LINES body lines, MAX_CHARS characters) so a record fits a 256-token row.

`stdlib_docstrings` (every public module), for a sequence-to-sequence model: a function's source
without its docstring -> the docstring's first line (at most MAX_SOURCE_CHARS / MAX_DOC_CHARS).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig

from framework.data.stdlib import stdlib_files
from framework.fileio import create_temporary

INSTRUCTION = "# Complete this function.\n"
MAX_BODY_LINES = 8
MAX_CHARS = 600
DATASETS = ("stdlib_functions", "stdlib_docstrings")
MAX_SOURCE_CHARS = 700
MAX_DOC_CHARS = 80


def _functions_of(path: str):
    """(function node, the module's lines) for every function of one module that parses."""
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            yield node, lines


def _pairs_of(path: str):
    for node, lines in _functions_of(path):
        body = node.body
        first = body[0]
        has_doc = (
            isinstance(first, ast.Expr)
            and isinstance(getattr(first, "value", None), ast.Constant)
            and isinstance(first.value.value, str)
        )
        rest = body[1:] if has_doc else body
        if not rest:
            continue
        head_end = rest[0].lineno - 1  # lines [def ... docstring] end before the first statement
        start = node.lineno - 1 - len(node.decorator_list)
        end = node.end_lineno
        if end - head_end > MAX_BODY_LINES:
            continue
        indent = len(lines[start]) - len(lines[start].lstrip())
        prompt = "".join(line[indent:] for line in lines[start:head_end])
        response = "".join(line[indent:] for line in lines[head_end:end])
        if len(prompt) + len(response) <= MAX_CHARS and response.strip():
            yield {"prompt": INSTRUCTION + prompt, "response": response}


def _docstring_pairs_of(path: str):
    """(function source without its docstring -> the docstring's first line) of one module."""
    for node, lines in _functions_of(path):
        if len(node.body) < 2:
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or not doc.strip().splitlines()[0].strip():
            continue
        first = doc.strip().splitlines()[0].strip()
        start = node.lineno - 1 - len(node.decorator_list)
        doc_node = node.body[0]
        indent = len(lines[start]) - len(lines[start].lstrip())
        kept = lines[start : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
        code = "".join(line[indent:] for line in kept)
        if len(code) <= MAX_SOURCE_CHARS and len(first) <= MAX_DOC_CHARS:
            yield {"prompt": code, "response": first}


def stdlib_docstring_records(limit: int = 4000) -> list:
    """Up to `limit` (function source -> first docstring line) pairs from every public stdlib module."""
    root = sysconfig.get_paths()["stdlib"]
    records = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and not name.startswith("_"):
            for record in _docstring_pairs_of(os.path.join(root, name)):
                records.append(record)
                if len(records) >= limit:
                    return records
    return records


def stdlib_function_records(limit: int = 4000) -> list:
    """Up to `limit` records, from the modules after those of the pre-training corpus."""
    root = sysconfig.get_paths()["stdlib"]
    seen = set(stdlib_files())
    modules = [
        os.path.join(root, n)
        for n in sorted(os.listdir(root))
        if n.endswith(".py") and not n.startswith("_") and os.path.join(root, n) not in seen
    ]
    records = []
    for path in modules:
        for record in _pairs_of(path):
            records.append(record)
            if len(records) >= limit:
                return records
    return records


def ensure_dataset(name: str, cache_dir: str) -> str:
    """The JSONL file of the embedded set `name`, written into `cache_dir` once (atomically)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    path = os.path.join(os.path.abspath(cache_dir), f"sft-{name}-py{version}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with create_temporary(tmp) as f:  # never through a planted link
            make = stdlib_docstring_records if name == "stdlib_docstrings" else stdlib_function_records
            f.writelines(json.dumps(record) + "\n" for record in make())
        os.replace(tmp, path)
    return path
