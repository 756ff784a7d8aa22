"""A package the lock files pin is part of the test environment: a test file that needs one fails
when it is missing, naming the lock file, instead of skipping (a skipped file reads as a pass)."""

import os
import subprocess
import sys

from conftest import REPO

LOCK = "requirements-tools.lock"
# Test files whose every test needs a pinned package, and the package their error names first.
NEEDS = {
    "tests/integration/test_trackers.py": "wandb",
    "tests/integration/test_evaluate.py": "lm_eval",
    "tests/data/test_hf_data.py": "datasets",
}


def test_a_missing_pinned_package_fails_the_files_that_need_it(tmp_path):
    """Each package shadowed by one whose import fails, as an uninstalled one's does: collecting
    the files is an error per file naming the package and requirements-tools.lock, nothing skips."""
    for name in ("wandb", "mlflow", "lm_eval", "datasets"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsE", "--collect-only", *NEEDS],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "300"},  # summary lines unshortened
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout[-3000:]  # collection errors: pytest's "interrupted"
    assert "skipped" not in out.stdout, out.stdout[-3000:]
    assert f"{len(NEEDS)} errors" in out.stdout, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    for path, name in NEEDS.items():
        why = f"{name} cannot be imported (No module named '{name}'): {LOCK} pins it; `make venv` installs it"
        assert why in lines, (path, out.stdout[-3000:])  # the file's error, in one line
        assert f"ERROR {path} - Failed: {why}" in lines, (path, out.stdout[-3000:])  # and in the summary
