"""The composition matrix ([Note: the composition matrix] in tests/integration/composition.py):
validation's refusals of every pair of settings are the rows of docs/engine.md's composition
table, no more and no fewer; the cases cover every allowed pair and each passes validation; and
each case's 5 steps equal its reference. The quick cases run by default, all 25 with
COMPOSITION_ALL=1 (2-4 gloo ranks each)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import composition as C
import pytest

REPO = Path(__file__).resolve().parents[2]
ALL = os.environ.get("COMPOSITION_ALL") == "1"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("composition"))
    C.write_data(root)
    return root


@pytest.fixture(scope="module")
def validator():
    v = C.Validator()
    yield v
    v.close()


@pytest.fixture(scope="module")
def refused(validator, data_dir):
    return C.refusals(validator, data_dir)


def doc_rows() -> list:
    """docs/engine.md's composition table: [(setting, with, reason)], `dim=*` for every value."""
    text = (REPO / "docs" / "engine.md").read_text()
    start = text.index("<!-- composition table -->")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if cells[0] in ("setting", "") or set(cells[0]) <= {"-", " "}:
            continue
        rows.append((cells[0], cells[1], cells[2]))
    return rows


def _matches(cell: str, value: C.Value) -> bool:
    dim, _, v = cell.partition("=")
    return dim == value[0] and v in ("*", value[1])


def _row_of(key, rows):
    for a, b, reason in rows:
        if len(key) == 1 and b in ("", "-") and _matches(a, key[0]):
            return reason
        if len(key) == 2 and any(_matches(x, key[0]) and _matches(y, key[1]) for x, y in ((a, b), (b, a))):
            return reason
    return None


def _name(key) -> str:
    return " with ".join(f"{d}={v}" for d, v in key)


def test_every_refusal_is_in_the_docs_table_with_its_reason_and_no_row_is_stale(refused):
    rows = doc_rows()
    assert rows, "docs/engine.md has no composition table"
    missing = [f"{_name(k)}: {problems[0]}" for k, problems in refused.items() if not _row_of(k, rows)]
    assert not missing, "refused by validation, not in docs/engine.md's composition table:\n" + "\n".join(missing)
    for a, b, reason in rows:
        assert len(reason) > 10, f"row {a} | {b}: give the reason"
        # A row names a refused pair; one that validation allows (a refusal lifted) must go.
        hits = [k for k in refused if _row_of(k, [(a, b, reason)])]
        assert hits, f"docs/engine.md lists {a} with {b} as refused, and validation allows it: remove the row"


def test_the_cases_cover_every_allowed_pair_and_each_passes_validation(refused, validator, data_dir):
    def allowed(pair) -> bool:
        a, b = pair
        keys = [(a,), (b,), (a, b), (b, a)]
        return not any(k in refused for k in keys)

    pairs = [p for p in C.all_pairs() if allowed(p)]
    assert len(pairs) > 300  # the matrix spans 13 settings
    missing = set(pairs) - C.covered(C.CASES)
    assert not missing, f"{len(missing)} allowed pairs meet in no case, e.g. {sorted(missing)[:5]}"
    names = [c.name for c in C.CASES]
    assert len(set(names)) == len(names)
    for c in C.CASES:
        overrides, world = C.overrides_of(c.values, data_dir)
        assert world <= 4, c.name
        assert validator.problems(overrides, world) == [], c.name
        reference = c.reference
        assert reference == "one process" or C.by_name(reference), (c.name, reference)


# ---- the runs ---------------------------------------------------------------------------------

STEPS = 5


def _losses(args, world, run_dir, cwd):
    from conftest import run_main

    args = [a for a in args if not a.startswith("cluster.nproc_per_node=")]
    args += [f"cluster.nproc_per_node={world}", f"trainer.max_steps={STEPS}", f"hydra.run.dir={run_dir}"]
    out = run_main(args, cwd, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r.get("grad_norm")) for r in records if "loss" in r and "step" in r]


@pytest.mark.parametrize("name", [c.name for c in C.CASES if c.quick or ALL])
def test_the_case_equals_its_reference(name, data_dir, tmp_path):
    c = C.by_name(name)
    args, world = C.overrides_of(c.values, data_dir)
    got = _losses(args, world, tmp_path / "case", tmp_path)
    if c.reference == "one process":
        ref_args, ref_world = C.overrides_of(C.one_process(c.values), data_dir)
    else:
        ref_args, ref_world = C.overrides_of(C.by_name(c.reference).values, data_dir)
    assert ref_world == 1 or c.reference != "one process"
    want = _losses(ref_args, ref_world, tmp_path / "reference", tmp_path)
    assert len(got) == len(want) == STEPS, (got, want)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), 1):
        # c.why says why the tolerance is what it is
        assert loss == pytest.approx(ref_loss, rel=c.tolerance), (step, got, want)
        if norm is not None and ref_norm is not None:
            assert norm == pytest.approx(ref_norm, rel=c.tolerance), (step, got, want)


def test_the_docs_name_the_opt_in_variable():
    text = (REPO / "docs" / "engine.md").read_text()
    assert re.search(r"COMPOSITION_ALL=1", text)
