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
    {"config", "fileio", "offline", "task_files"},
    {"loss_plot"},
    {"models", "data", "optim", "distributed", "peft", "metrics", "train_state", "runtime", "profiling", "trackers"},
    {"finetune", "checkpoint", "stop", "planner", "downstream", "preflight"},
    {"trainer"},
    {"generate", "evaluate"},
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


def _framework_imports(path) -> set:
    """The framework packages a file imports (`framework.X...` -> X), lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "framework" else [f"framework.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("framework.")}
    return found


def test_imports_point_down_the_layers():
    """main -> entrypoint -> trainer -> {models, distributed, data, optim, checkpoint, ...} -> config
    -> errors, read from every file's imports (including the ones inside functions)."""
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for path in sorted((REPO / "framework").rglob("*.py")):
        parts = path.relative_to(REPO / "framework").with_suffix("").parts
        if parts == ("__init__",):
            continue
        own = parts[0]
        assert own in layer_of, f"framework/{own}: place it in LAYERS (tests/unit/test_layering.py)"
        for target in _framework_imports(path) - {own}:
            assert target in layer_of, f"{path}: imports framework.{target}, which is in no layer"
            if layer_of[target] >= layer_of[own]:
                wrong.append(f"{path.relative_to(REPO)} imports framework.{target}")
    assert wrong == []
