"""lm-eval task files, read without lm-eval: the task names a folder defines, and what in them would
run code. Read before any rank starts (framework/preflight.py) and by framework/downstream.py.

[Note: indexing lm-eval's tasks without lm-eval]
lm-eval's TaskManager parses every one of its ~14,000 built-in task YAMLs, and parses a shared
template again for each file that includes it: 12 s on an idle 2-core machine, 47 s beside other
jobs, in every rank, before it can say that a task name is unknown. `task_index` parses each file
once (libyaml's C loader; a `!function` tag is kept as its text and never imported), merges a
file's `include:` chain from that one parse, and names what lm-eval's index names: a task's `task`,
a group's `group`, each `tag` of a task, the first file to use a name keeping it. lm-eval's
built-in folder takes ~1 s this way (measured on the same machine), once per process
(`builtin_index`); a folder of the user's own takes milliseconds.

[Note: task files that run code]
A task YAML is more than data: lm-eval imports and calls the Python a `!function module.fn` tag
names (`class:` tasks, `process_docs`, `doc_to_text`, filters, metrics), loads a metric it does not
know itself through Hugging Face `evaluate` (which imports that metric's script, from a local
folder or the hub's cache), and renders its prompts with Jinja, whose templates can reach Python's
internals (`{{ x.__class__... }}`). Task files from `evaluate.include_path`, and every file they
include from outside lm-eval's own installed tasks, are refused when they do any of this, unless
`evaluate.trust_task_code=true`; lm-eval's own task files (its installed package) are lm-eval's
code and trusted as the package is. Without the opt-in the templates also render in Jinja's
sandbox (framework/downstream.py), which stops what a template could compute at run time that no
reading of it can see.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

_IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # lm-eval's own list


class Code(str):
    """The text of a `!function module.fn` tag: what lm-eval would import and call."""


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # the loader lm-eval uses, data only
    pass


_Loader.add_constructor("!function", lambda loader, node: Code(loader.construct_scalar(node)))


@dataclass(frozen=True)
class Entry:
    """A name lm-eval's index would hold: kind is task, python task, group or tag."""

    name: str
    kind: str
    path: str  # the YAML file that defines it; "" for a tag


# The top-level keys that name a task file's tasks (plain or quoted), and the lines that would make
# reading only those keys unsafe: a document marker, a directive, a flow or complex top-level
# mapping, a merge key. A file with one of those is parsed whole.
_NAME_KEYS = re.compile(rb"""^(["']?)(task|group|tag|include|class)\1[ \t]*:""", re.M)
_UNUSUAL = re.compile(rb"^(---|\.\.\.|%|\{|\[|\?|<<|[\"']?<<)", re.M)
_TOP_LEVEL = re.compile(rb"^[^\s#-]", re.M)


# `key: value` alone on its line, the value a plain word or a quoted one without escapes: read as
# YAML reads it without the parser (YAML 1.1's booleans and nulls are not words here).
_SIMPLE = re.compile(
    rb"""(["']?)(task|group|tag|include|class)\1[ \t]*:[ \t]*"""
    rb"""(?:"([^"\\]*)"|'([^']*)'|([A-Za-z_][\w./-]*))"""
)
_NOT_WORDS = {b"yes", b"no", b"true", b"false", b"on", b"off", b"null", b"y", b"n"}


def _name_keys(data: bytes):
    """The top-level blocks of `data` that hold task, group, tag, include and class, read alone:
    lm-eval's index reads nothing else, and this is several times faster than parsing the whole
    file ([Note: indexing lm-eval's tasks without lm-eval]). The whole file when that is not safe."""
    if _UNUSUAL.search(data):
        return yaml.load(data, Loader=_Loader)  # noqa: S506 - a safe loader
    found, blocks, keys = {}, [], []
    for match in _NAME_KEYS.finditer(data):
        block = data[match.start() : _end_of(data, match.end())].rstrip()
        keys.append(match.group(2))
        simple = _SIMPLE.fullmatch(block)
        word = simple and simple.group(5)
        if simple and not (word and word.lower() in _NOT_WORDS):
            value = next(v for v in simple.group(3, 4, 5) if v is not None)
            found[match.group(2).decode()] = value.decode("utf-8")
        else:
            blocks.append(block)
    if len(set(keys)) < len(keys):  # a key given twice: the parser decides which one holds
        found, blocks = {}, [data[m.start() : _end_of(data, m.end())] for m in _NAME_KEYS.finditer(data)]
    if not blocks:
        return found
    try:
        rest = yaml.load(b"\n".join(blocks), Loader=_Loader)  # noqa: S506 - a safe loader
    except yaml.YAMLError:  # an alias to an anchor elsewhere in the file, ...
        return yaml.load(data, Loader=_Loader)  # noqa: S506 - a safe loader
    return {**found, **rest} if isinstance(rest, dict) else yaml.load(data, Loader=_Loader)  # noqa: S506


def _end_of(data: bytes, start: int) -> int:
    end = _TOP_LEVEL.search(data, start)
    return end.start() if end else len(data)


class _Files:
    """Every YAML file read once: its parsed content, or the exception parsing raised. With `names`,
    only the keys that name tasks are read (`_name_keys`)."""

    def __init__(self, names: bool = False) -> None:
        self._parsed: Dict[str, object] = {}
        self._names = names

    def parsed(self, path: str):
        if path not in self._parsed:
            try:
                with open(path, "rb") as handle:
                    data = handle.read()
                self._parsed[path] = _name_keys(data) if self._names else yaml.load(data, Loader=_Loader)  # noqa: S506
            except Exception as exc:  # noqa: BLE001 - kept, and raised to whoever asks for the file
                self._parsed[path] = exc
        got = self._parsed[path]
        if isinstance(got, Exception):
            raise got
        return got

    def merged(self, path: str, seen: Tuple[str, ...] = ()) -> dict:
        """The file's config with its `include:` chain merged as lm-eval merges it: the included
        files in order (without their task_list), then the file's own keys."""
        path = _real(path)
        if path in seen:
            raise ValueError(f"include cycle at {path}")
        cfg = self.parsed(path)
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} is not a mapping")
        if "include" not in cfg:
            return cfg
        merged: dict = {}
        for include in _includes(cfg):
            sub = self.merged(_beside(path, include), (*seen, path))
            merged.update({k: v for k, v in sub.items() if k != "task_list"})
        merged.update({k: v for k, v in cfg.items() if k != "include"})
        return merged

    def chain(self, path: str, seen: set) -> List[str]:
        """`path` and every file its `include:` chain names, each once (unreadable ones too)."""
        path = _real(path)
        if path in seen:
            return []
        seen.add(path)
        found = [path]
        try:
            cfg = self.parsed(path)
        except Exception:  # noqa: BLE001 - judged by _code_in
            return found
        for include in _includes(cfg) if isinstance(cfg, dict) else []:
            if isinstance(include, str):
                found += self.chain(_beside(path, include), seen)
        return found


def _includes(cfg: dict) -> list:
    includes = cfg.get("include")
    return includes if isinstance(includes, list) else [includes] if includes is not None else []


def _beside(path: str, include: str) -> str:
    return include if os.path.isabs(include) else os.path.join(os.path.dirname(path), include)


def _real(path: str) -> str:
    # not os.path.realpath: its lstat of every component was a third of the index's time
    return os.path.abspath(os.path.expanduser(path))


def yaml_files(root: str) -> List[str]:
    """The task YAMLs under `root`, in lm-eval's order (sorted by path; caches skipped)."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _IGNORED_DIRS]
        found += [os.path.join(folder, n) for n in names if n.endswith(".yaml")]
    return sorted(found)


def _add(cfg: dict, path: str, index: Dict[str, Entry]) -> None:
    """One file's names, as lm-eval's TaskIndex.process_cfg records them."""
    if "class" in cfg:
        kind, name = "python task", cfg["task"]
    elif "group" in cfg:
        kind, name = "group", cfg["group"]
    elif "task" in cfg:
        kind, name = "task", cfg["task"]
    else:
        return  # lm-eval skips a file of another shape
    if not isinstance(name, str) or name in index:
        return  # the first file to use a name keeps it
    index[name] = Entry(name, kind, path)
    if kind != "group":
        tags = cfg.get("tag")
        for tag in tags if isinstance(tags, list) else [tags] if tags else []:
            if isinstance(tag, str):
                index.setdefault(tag, Entry(tag, "tag", ""))


def task_index(roots: Sequence[str]) -> Dict[str, Entry]:
    """Every name the task YAMLs under `roots` define; a later root's names replace an earlier's
    (lm-eval's order: its own tasks, then evaluate.include_path)."""
    files, index = _Files(names=True), {}
    for root in roots:
        own: Dict[str, Entry] = {}
        for path in yaml_files(root):
            try:
                _add(files.merged(path), path, own)
            except Exception:  # noqa: BLE001,S112 - lm-eval skips a file it cannot read, and so do we
                continue
        index.update(own)
    return index


def lm_eval_tasks_dir() -> Optional[str]:
    """lm-eval's installed tasks folder (found without importing lm-eval); None if not installed."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "tasks")


@functools.lru_cache(maxsize=None)
def builtin_index() -> Dict[str, Entry]:
    """lm-eval's own task names, indexed once per process ([Note: indexing lm-eval's tasks without
    lm-eval])."""
    root = lm_eval_tasks_dir()
    return task_index([root]) if root else {}


def unknown_tasks(names: Iterable[str], include_path: str) -> List[str]:
    """The names neither `include_path` nor lm-eval's own tasks define."""
    local = task_index([include_path]) if include_path else {}
    missing = [n for n in names if n not in local]
    if missing:
        missing = [n for n in missing if n not in builtin_index()]
    return missing


def local_task_files(names: Iterable[str], include_path: str) -> Dict[str, List[str]]:
    """{name: the files under `include_path` that lm-eval loads to run task `name`}: the file that
    defines it, for a group its members' files too (members named by name, recursively; members
    written inline are in the group's file), for a tag every local file of a task with that tag.
    A name lm-eval's own tasks define is not listed (lm-eval's files are its code)."""
    files, paths, index = _Files(names=True), yaml_files(include_path), {}
    cfgs: Dict[str, dict] = {}
    for path in paths:
        try:
            cfg = files.merged(path)
        except Exception:  # noqa: BLE001,S112 - skipped as lm-eval skips it (its name unknown)
            continue
        cfgs[path] = cfg
        _add(cfg, path, index)

    def of(name: str, seen: Tuple[str, ...]) -> List[str]:
        entry = index.get(name)
        if entry is None or name in seen:
            return []
        if entry.kind == "tag":
            return [
                p
                for p, cfg in cfgs.items()
                if "group" not in cfg and isinstance(cfg.get("task"), str) and name in _listed(cfg.get("tag"))
            ]
        found = [entry.path]
        if entry.kind == "group":
            for member in _listed(cfgs[entry.path].get("task")):
                if isinstance(member, str):
                    found += of(member, (*seen, name))
        return found

    return {name: list(dict.fromkeys(of(name, ()))) for name in names}


def _listed(value) -> list:
    return value if isinstance(value, list) else [value] if value is not None else []


def unreadable_task_file(names: Iterable[str], include_path: str) -> Optional[str]:
    """The refusal of the first task file (or a file it includes) that lm-eval would need for
    `names` and could not read (YAML that does not parse, an include that is missing or a cycle,
    a file that is not a mapping), naming the file and why; or None. lm-eval's index skips such a
    file, and the ranks would only say that the task does not exist."""
    files = _Files()
    for name, paths in local_task_files(names, include_path).items():
        for path in paths:
            try:
                files.merged(path)
            except Exception as exc:  # noqa: BLE001 - every reason lm-eval would skip the file
                return f"evaluate.include_path: {path} (task {name}) cannot be read: {_why(exc)}; fix the file"
    return None


def unparsable_files(include_path: str) -> List[Tuple[str, str]]:
    """(file, why) for each task YAML under `include_path` whose task names cannot be read: a task
    it defines is unknown to lm-eval too."""
    files, found = _Files(names=True), []
    for path in yaml_files(include_path):
        try:
            files.merged(path)
        except Exception as exc:  # noqa: BLE001 - every reason lm-eval would skip the file
            found.append((path, _why(exc)))
    return found


def _why(exc: Exception) -> str:
    """One line saying why a YAML file could not be read."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        return f"not YAML ({' '.join(filter(None, [exc.context, exc.problem]))}{where})"
    if isinstance(exc, yaml.YAMLError):
        return f"not YAML ({' '.join(str(exc).split())})"
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return " ".join(str(exc).split())


def code_in_task_files(include_path: str, names: Optional[Iterable[str]] = None) -> List[Tuple[str, str]]:
    """(file, what it would run) for each task file under `include_path` (only those that tasks
    `names` load, when given: `local_task_files`), and each file they include from outside
    lm-eval's installed tasks, that names code ([Note: task files that run code])."""
    trusted = lm_eval_tasks_dir()
    trusted = os.path.realpath(trusted) + os.sep if trusted else None
    if names is None:
        roots = yaml_files(include_path)
    else:
        roots = list(dict.fromkeys(p for paths in local_task_files(names, include_path).values() for p in paths))
    files, seen, chain = _Files(), set(), []
    for path in roots:
        chain += files.chain(path, seen)
    found = []
    for path in chain:
        if trusted and os.path.realpath(path).startswith(trusted):
            continue
        what = _code_in(files, path)
        if what:
            found.append((path, what))
    return found


def code_problem(include_path: str, names: Optional[Iterable[str]] = None) -> Optional[str]:
    """The refusal of `include_path`'s task files when they name code (the first such file, and how
    many more), or None. With `names`, only the files those tasks load count: a folder may hold
    a task that names code beside tasks that do not, and only the first is refused."""
    found = code_in_task_files(include_path, names)
    if not found:
        return None
    path, what = found[0]
    more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
    return (
        f"evaluate.include_path: {path} names code lm-eval would run: {what}{more}; set "
        "evaluate.trust_task_code=true to run the task files' code (only for files you trust)"
    )


def _code_in(files: _Files, path: str) -> Optional[str]:
    try:
        cfg = files.parsed(path)
    except yaml.constructor.ConstructorError as exc:
        return f"a YAML tag lm-eval's loader would not read as data ({exc.problem})"
    except Exception:  # noqa: BLE001 - unreadable: lm-eval cannot load it either
        return None
    for value in _values(cfg):
        if isinstance(value, Code):
            return f"!function {value}"
    for metric in (cfg.get("metric_list") if isinstance(cfg, dict) else None) or []:
        what = _metric_code(metric)
        if what:
            return what
    for value in _values(cfg):
        what = unsafe_template(value) if isinstance(value, str) else None
        if what:
            return what
    return None


def _values(tree) -> Iterable[object]:
    """Every key and value of a parsed YAML document."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, dict):
            stack += [*node.keys(), *node.values()]
        elif isinstance(node, list):
            stack += node


def _metric_code(metric) -> Optional[str]:
    """A metric lm-eval would load through Hugging Face `evaluate`, which imports its script."""
    if not isinstance(metric, dict) or not isinstance(metric.get("metric"), str):
        return None
    name = metric["metric"]
    if metric.get("hf_evaluate") is True:
        return f"metric {name} with hf_evaluate: true (Hugging Face evaluate imports its script)"
    if name not in _lm_eval_metrics():
        return f"metric {name}, not one of lm-eval's own (Hugging Face evaluate would import its script)"
    return None


@functools.lru_cache(maxsize=None)
def _lm_eval_metrics() -> frozenset:
    try:
        import lm_eval.api.metrics  # noqa: F401 - registers lm-eval's metrics (~0.1 s)
        from lm_eval.api.registry import metric_registry
    except ImportError:
        return frozenset()
    return frozenset(metric_registry)


# What Jinja's sandbox refuses besides names starting with "_" (jinja2/sandbox.py), and str.format,
# whose replacement fields walk attributes themselves.
_UNSAFE_ATTRIBUTES = frozenset(
    {"mro", "format", "format_map"}
    | {"func_closure", "func_code", "func_dict", "func_defaults", "func_globals"}
    | {"im_class", "im_func", "im_self", "gi_frame", "gi_code", "cr_frame", "cr_code"}
    | {"ag_code", "ag_frame", "tb_frame", "f_globals", "f_locals", "f_builtins", "f_code"}
)


def unsafe_template(text: str) -> Optional[str]:
    """What in a Jinja template reaches past data into Python (an attribute named with "_", the
    `attr` filter, ...), or None. Only what the template spells out; the sandbox stops the rest."""
    if "{{" not in text and "{%" not in text:
        return None
    from jinja2 import Environment, nodes

    try:
        tree = Environment().parse(text)
    except Exception:  # noqa: BLE001 - a template that does not parse cannot render either
        return None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Filter) and node.name == "attr":
            return "a Jinja template using the attr filter"
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
            name = node.arg.value
        else:
            continue
        if isinstance(name, str) and (name.startswith("_") or name in _UNSAFE_ATTRIBUTES):
            return f"a Jinja template reaching .{name}"
    return None
