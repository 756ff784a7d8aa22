"""CI's entry point (.ci/run) ends with the number of skipped tests and each one's reason, from both
phases of `make test`, also when the tests fail (its status is the tests')."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

MODULE = "test_demo"  # a test file written for each test, with a skip, a skipif and an xfail
DEMO = """
import pytest


def test_runs():
    pass


def test_skipped_inside():
    pytest.skip("no widget here: apt-get install widget")


@pytest.mark.skipif(True, reason="needs a GPU")
def test_marked():
    pass


@pytest.mark.xfail(strict=True, reason="a known gap")
def test_known_gap():
    assert False
"""


def _summary(reports: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(REPO / ".ci" / "skips.py"), str(reports)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_test_lists_skips_and_writes_a_report_per_phase(tmp_path):
    """Both pytest phases print their skips' reasons (-rs, with failures and errors: -rfEs) and
    write a JUnit report where .ci/run reads it."""
    out = subprocess.run(
        ["make", "-n", "test", f"TEST_REPORTS={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    phases = [line for line in out.stdout.splitlines() if " -m pytest " in line]
    assert len(phases) == 2, out.stdout
    for line, phase in zip(phases, ("parallel", "serial")):
        assert " -rfEs " in line and f" --junitxml={tmp_path}/{phase}.xml " in line, line
    assert '-m "not serial"' in phases[0] and "-m serial" in phases[1]


def test_the_summary_counts_skips_with_their_reasons_and_names_a_phase_that_did_not_run(tmp_path):
    (tmp_path / f"{MODULE}.py").write_text(DEMO)
    reports = tmp_path / "reports"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={reports}/parallel.xml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout
    assert _summary(reports).splitlines() == [
        f"serial phase: no report ({reports}/serial.xml missing: the phase did not run)",
        "skipped: 2",
        "  [parallel] test_demo::test_skipped_inside: no widget here: apt-get install widget",
        "  [parallel] test_demo::test_marked: needs a GPU",
        "expected to fail (xfail): 1",
        "  [parallel] test_demo::test_known_gap: a known gap",
    ]


def test_ci_run_ends_with_the_summary_and_keeps_the_tests_status(tmp_path):
    """.ci/run with a stand-in for make whose `make test` writes one phase's report and fails: the
    summary is the last thing printed, and the job's status is the failed test phase's."""
    (tmp_path / f"{MODULE}.py").write_text(DEMO)
    bin_dir, reports = tmp_path / "bin", tmp_path / "reports"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(
        "#!/bin/sh\n"
        f'echo "make $*" >> {tmp_path}/make.log\n'
        '[ "$1" = test ] || exit 0\n'
        'reports="${2#TEST_REPORTS=}"\n'
        f"cd {tmp_path} && {sys.executable} -m pytest -q -p no:cacheprovider --junitxml=$reports/parallel.xml "
        f"{MODULE}.py >/dev/null\n"
        "exit 2\n"
    )
    (bin_dir / "make").chmod(0o755)
    # What .ci/run needs besides make; no apt-get on PATH: nothing is installed.
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    out = subprocess.run(
        [shutil.which("bash"), str(REPO / ".ci" / "run")],
        env={"PATH": str(bin_dir), "TEST_REPORTS": str(reports), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert (tmp_path / "make.log").read_text().splitlines() == [
        "make venv",
        "make lint",
        f"make test TEST_REPORTS={reports}",
    ]
    assert out.stdout.endswith(_summary(reports)), out.stdout
    assert "skipped: 2\n" in out.stdout


def _ci_with_apt(tmp_path, apt_install_status: int, tools: tuple):
    """.ci/run as root (a stand-in `id`) with a stand-in apt-get whose install exits
    `apt_install_status`, the commands `tools` on PATH, and a make that only logs its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "id": "#!/bin/sh\necho 0\n",
        "apt-get": f'#!/bin/sh\n[ "$1" = install ] && exit {apt_install_status}\nexit 0\n',
        "make": f'#!/bin/sh\necho "make $*" >> {tmp_path}/make.log\n',
        **{tool: "#!/bin/sh\nexit 0\n" for tool in tools},
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    os.symlink(shutil.which("dirname"), bin_dir / "dirname")
    return subprocess.run(
        [shutil.which("bash"), str(REPO / ".ci" / "run")],
        env={"PATH": str(bin_dir), "TEST_REPORTS": str(tmp_path / "reports"), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_system_package_that_does_not_install_fails_ci_before_the_tests(tmp_path):
    """apt-get failing to install what the Slurm tests need is CI's failure, not skipped tests."""
    out = _ci_with_apt(tmp_path, apt_install_status=100, tools=())
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "error: apt-get install slurm-wlm munge shellcheck gcc failed" in out.stderr
    assert not (tmp_path / "make.log").exists()  # neither the venv nor the tests ran


def test_an_installed_package_without_its_command_fails_ci(tmp_path):
    out = _ci_with_apt(tmp_path, apt_install_status=0, tools=("slurmctld", "slurmd"))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "error: munged is not on PATH" in out.stderr
    assert not (tmp_path / "make.log").exists()


def test_installed_system_packages_lead_on_to_the_tests(tmp_path):
    out = _ci_with_apt(tmp_path, apt_install_status=0, tools=("slurmctld", "slurmd", "munged", "cc"))
    assert (tmp_path / "make.log").read_text().splitlines()[:2] == ["make venv", "make lint"], out.stderr
