"""The skipped tests of `make test`'s two phases, counted and each with its reason: what `.ci/run`
prints last, from the JUnit reports the phases write (`TEST_REPORTS` in the Makefile).

    python .ci/skips.py outputs/test-reports     # parallel.xml, then serial.xml

A phase without its report (it did not run: the one before it failed) is named as such. Tests
expected to fail (xfail) are listed apart from the skips. The exit status is 0: the summary only
informs; the test phases' own statuses decide the job.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PHASES = ("parallel", "serial")


def _outcomes(report: Path):
    """(test id, kind, reason) of every test of `report` that did not run to a verdict."""
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None:
            continue
        name = f"{case.get('classname')}::{case.get('name')}"
        kind = "xfail" if skipped.get("type") == "pytest.xfail" else "skip"
        yield name, kind, skipped.get("message", "").strip()


def summary(folder: Path) -> str:
    lines, skips, xfails = [], [], []
    for phase in PHASES:
        report = folder / f"{phase}.xml"
        if not report.is_file():
            lines.append(f"{phase} phase: no report ({report} missing: the phase did not run)")
            continue
        for name, kind, reason in _outcomes(report):
            (xfails if kind == "xfail" else skips).append(f"  [{phase}] {name}: {reason}")
    lines.append(f"skipped: {len(skips)}")
    lines += skips
    if xfails:
        lines.append(f"expected to fail (xfail): {len(xfails)}")
        lines += xfails
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/test-reports")))
