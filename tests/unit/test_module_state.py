"""The rank runtime, the local rank starter and the in-memory snapshots are parts with one job each:
every file under 450 lines, and no state that outlives a call at module or class level except in
the one object that owns it (framework/runtime.py's `_this`). Read from the files' syntax trees."""

from __future__ import annotations

import ast

from conftest import REPO

MAX_LINES = 450
# file -> the module-level names that own its mutable state (at most one per file)
OWNERS = {
    "framework/runtime.py": {"_this"},
    "framework/local_ranks.py": set(),
    "framework/checkpoint/memory.py": set(),
    "framework/checkpoint/snapshot_format.py": set(),
    "framework/checkpoint/snapshot_files.py": set(),
    "framework/checkpoint/snapshot_peers.py": set(),
    "framework/checkpoint/snapshot_writer.py": set(),
    "framework/checkpoint/snapshot_restore.py": set(),
}
_MUTABLE = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.Call)


def _constant_name(name: str) -> bool:
    return name.lstrip("_").isupper()


def _names(target: ast.expr) -> list:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names(t)]
    return [ast.unparse(target)]


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def _state_outside_its_owner(path: str, owners: set, root=REPO) -> list:
    """'path:line: what' for each piece of mutable state at module or class level, and each
    `global` statement, outside `owners`."""
    tree = ast.parse((root / path).read_text())
    found = []

    def assigned(node, targets, value, where):
        for name in (n for t in targets for n in _names(t)):
            if name in owners and where == "module":
                continue
            if not _constant_name(name) or isinstance(value, _MUTABLE):
                found.append(f"{path}:{node.lineno}: {where} binds {name} = {ast.unparse(value)[:40]}")

    for node in tree.body:
        if isinstance(node, ast.Assign):
            assigned(node, node.targets, node.value, "module")
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            assigned(node, [node.target], node.value, "module")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.Assign):
                    assigned(item, item.targets, item.value, f"class {node.name}")
                elif isinstance(item, ast.AnnAssign) and item.value is not None and not _is_dataclass(node):
                    assigned(item, [item.target], item.value, f"class {node.name}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            found.append(f"{path}:{node.lineno}: `{ast.unparse(node)}`")
    return found


def test_each_part_is_under_the_line_limit():
    lengths = {path: len((REPO / path).read_text().splitlines()) for path in OWNERS}
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}, lengths


def test_no_mutable_state_at_module_or_class_level_but_its_owner():
    assert all(len(owners) <= 1 for owners in OWNERS.values())
    found = [line for path, owners in OWNERS.items() for line in _state_outside_its_owner(path, owners)]
    assert found == []


def test_the_reader_finds_module_globals_class_state_and_global_statements(tmp_path):
    """What the rank runtime held before it had one owner: module globals rebound with `global`,
    and a class whose attributes were the running heartbeat."""
    (tmp_path / "old.py").write_text(
        "import threading\n"
        "LIMIT_S = 5.0\n"
        "_attempt = 'generation_0'\n"
        "_this = object()\n"
        "class _Heartbeat:\n"
        "    step = 0\n"
        "    _stop = threading.Event()\n"
        "    KEY = 'framework/heartbeat'\n"
        "def join():\n"
        "    global _attempt\n"
        "    _attempt = 'generation_1'\n"
    )
    found = _state_outside_its_owner("old.py", {"_this"}, root=tmp_path)
    assert [line.split(": ", 1)[1] for line in found] == [
        "module binds _attempt = 'generation_0'",
        "class _Heartbeat binds step = 0",
        "class _Heartbeat binds _stop = threading.Event()",
        "`global _attempt`",
    ], found
