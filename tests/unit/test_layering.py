"""Imports point one way (main -> trainer -> {models, distributed, data, optim, checkpoint} -> config),
and each decision has one seam."""

import ast
import subprocess
import sys

from conftest import REPO

# The framework's packages and top-level modules, bottom first. A module imports only from layers
# strictly below its own, so models and the engine (both layer 2) never import each other, and
# nothing below the trainer imports it. A new package must be placed here.
LAYERS = [
    {"errors"},
    {"config", "fileio", "offline", "task_files", "param_roles", "recompute", "peft"},
    {"loss_plot"},
    {"models", "data", "optim", "distributed", "metrics", "train_state", "runtime", "profiling", "trackers"},
    {"finetune", "checkpoint", "stop", "planner", "downstream", "preflight", "generation", "routing", "local_ranks"},
    {"steps", "step_callbacks"},
    {"job", "deterministic"},
    {"trainer"},
    {"generate", "evaluate", "dpo", "grpo"},
    {"stages"},
    {"entrypoint"},
]


def _modules_after(statement: str) -> list:
    """The modules a fresh interpreter holds after `statement` (none preloaded by pytest)."""
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_config_imports_nothing_above_it():
    """framework.config (schema, validation, the degrees arithmetic, Hydra registration) imports no
    other framework package than framework.errors, and no torch: the launcher validates with it on
    a machine without torch, and nothing below can import the layers above it."""
    modules = _modules_after("import framework.config; framework.config.compose_config(['parallelism=hybrid'])")
    assert "framework.config.degrees" in modules  # the degrees arithmetic did load
    above = [
        m for m in modules if m.startswith("framework.") and not m.startswith(("framework.config", "framework.errors"))
    ]
    assert above == []
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []


def test_every_engine_choice_has_one_engine_record():
    """`parallelism.engine` choices and the engine records (framework/distributed/engines.py) agree."""
    from framework.config.schema import Engine
    from framework.distributed.engines import ENGINES, engine_of

    assert sorted(ENGINES) == sorted(e.value for e in Engine)
    for choice in Engine:
        assert engine_of(choice) is engine_of(choice.value) is ENGINES[choice.value]


def test_every_data_choice_has_one_source():
    """`data.name` choices and the data sources (framework/data/build.py) agree."""
    from framework.config.schema import DataName
    from framework.data.build import SOURCES

    assert sorted(SOURCES) == sorted(e.value for e in DataName)
    assert all(SOURCES[name].name == name for name in SOURCES)


def _framework_modules() -> dict:
    """Every module of framework/ by its dotted name (a package by its own name), to its file."""
    out = {}
    for path in sorted((REPO / "framework").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports_of(module: str, path, modules) -> dict:
    """{framework module: line} that `module` imports: at module level, inside functions and
    under `if TYPE_CHECKING:` alike (ast.walk reads them all), relative imports resolved against
    the package they are in, each name of a `from X import name` that is a module counted as it."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # framework.data.loader.DataBundle -> framework.data.loader
                name = name.rpartition(".")[0]
            if name.startswith("framework") and name != module:
                found.setdefault(name, node.lineno)
    return found


def _import_graph() -> dict:
    modules = _framework_modules()
    return {m: _imports_of(m, path, modules) for m, path in modules.items()}


def _circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm), each with
    the imports inside it as "a -> b (line n)"."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(
                    sorted(f"{a} -> {b} (line {n})" for a in component for b, n in graph[a].items() if b in component)
                )

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_reader_sees_lazy_relative_and_type_checking_imports(tmp_path):
    """The reader the two tests below use: an import inside a function, a relative one (resolved
    against its package, `..` included) and one under `if TYPE_CHECKING:` are all edges."""
    root = tmp_path / "framework"
    pkg = root / "pkg"
    pkg.mkdir(parents=True)
    files = {f"framework.pkg.{n}": (pkg / n).with_suffix(".py") for n in ("a", "b", "c", "d")}
    files |= {
        "framework.pkg": (pkg / "__init__").with_suffix(".py"),
        "framework.top": (root / "top").with_suffix(".py"),
    }
    for path in files.values():
        path.write_text("")
    files["framework.pkg.a"].write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "if TYPE_CHECKING:\n    from .c import Thing\n"
        "def f():\n    from ..top import x\n    import framework.pkg.d\n"
    )
    assert _imports_of("framework.pkg.a", files["framework.pkg.a"], files) == {
        "framework.pkg.b": 2,
        "framework.pkg.c": 4,
        "framework.top": 6,
        "framework.pkg.d": 7,
    }
    assert _circles({"x": {"y": 1}, "y": {"z": 2}, "z": {"x": 3}, "w": {"x": 4}}) == [
        ["x -> y (line 1)", "y -> z (line 2)", "z -> x (line 3)"]
    ]


def test_the_framework_has_no_import_circle():
    """No two modules of framework/ import each other, directly or through others, counting imports
    inside functions and under TYPE_CHECKING: a circle is broken by moving the shared piece to the
    lower module or into a small module of its own, not by hiding the import."""
    assert _circles(_import_graph()) == []


def test_imports_point_down_the_layers():
    """main -> entrypoint -> trainer -> {models, distributed, data, optim, checkpoint, ...} -> config
    -> errors, read from every file's imports (inside functions, relative and TYPE_CHECKING ones
    included)."""
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for module, imports in sorted(_import_graph().items()):
        parts = module.split(".")[1:]
        if not parts:
            continue
        own = parts[0]
        assert own in layer_of, f"framework/{own}: place it in LAYERS (tests/unit/test_layering.py)"
        for target in {t.split(".")[1] for t in imports if t != "framework"} - {own}:
            assert target in layer_of, f"{module}: imports framework.{target}, which is in no layer"
            if layer_of[target] >= layer_of[own]:
                wrong.append(f"{module} imports framework.{target}")
    assert wrong == []


def test_bench_imports_nothing_from_tests():
    """The benchmarks stand on the framework (and bench/ itself): no import of tests/ or its
    conftest, at module level or inside functions, so they run from a checkout without tests/."""
    wrong = []
    for path in sorted((REPO / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            wrong += [
                f"{path.relative_to(REPO)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] in ("tests", "conftest")
            ]
    assert wrong == []
