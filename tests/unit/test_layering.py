"""Imports point one way (main -> trainer -> {models, distributed, data, optim, checkpoint} -> config),
and each decision has one seam."""
import subprocess
import sys

from conftest import REPO


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
    above = [m for m in modules if m.startswith("framework.")
             and not m.startswith(("framework.config", "framework.errors"))]
    assert above == []
    assert [m for m in modules if m == "torch" or m.startswith("torch.")] == []


def test_every_engine_choice_has_one_engine_record():
    """`parallelism.engine` choices and the engine records (framework/distributed/engines.py) agree."""
    from framework.config.schema import Engine
    from framework.distributed.engines import ENGINES, engine_of

    assert sorted(ENGINES) == sorted(e.value for e in Engine)
    for choice in Engine:
        assert engine_of(choice) is engine_of(choice.value) is ENGINES[choice.value]
