"""The composition matrix ([Note: the composition matrix] in tests/integration/composition.py):
validation's refusals of every pair of settings are the rows of docs/engine.md's composition
table, no more and no fewer; the cases cover every allowed pair and each passes validation; and
each case's 5 steps equal its reference. The quick cases run by default, all of them with
COMPOSITION_ALL=1 (2-4 gloo ranks each)."""

from __future__ import annotations

import json
import os
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


def _name(key) -> str:
    return " with ".join(f"{d}={v}" for d, v in key)


def test_every_pair_validation_refuses_is_a_row_of_the_docs_table(refused):
    rows = C.doc_rows(str(REPO))
    missing = [f"{_name(k)}: {problems[0]}" for k, problems in refused.items() if not any(r.refuses(k) for r in rows)]
    assert not missing, "refused by validation, not in docs/engine.md's composition table:\n" + "\n".join(missing)


def test_every_refusal_in_the_code_is_a_row_of_the_docs_table():
    found = C.code_refusals(str(REPO))
    assert len(found) > 20  # the config's, the families', the pipeline's
    rows = C.doc_rows(str(REPO))
    missing = [f"{path}: {text}" for path, a, b, text in found if not any(r.lists(a, b) for r in rows)]
    assert not missing, "refusals not in docs/engine.md's composition table:\n" + "\n".join(missing)


def test_no_row_of_the_docs_table_is_stale(refused):
    """A row is a refusal validation makes, or a message in the code; one whose refusal was lifted
    must go (the cover then asks for a case holding the pair)."""
    found = C.code_refusals(str(REPO))
    for r in C.doc_rows(str(REPO)):
        assert len(r.why) > 10 and r.when, f"row {r.a} | {r.b}: say when and why"
        in_code = any(r.lists(a, b) for _, a, b, _ in found)
        assert in_code or any(r.refuses(k) for k in refused), f"docs/engine.md refuses {r.a} with {r.b}; nothing does"


def test_the_validators_compose_is_hydras(validator, data_dir):
    """The validator composes once per choice of groups and sets the values as Hydra does: the
    same config as Hydra's own compose, for one case of each such choice and the widest cases."""
    seen, sample = set(), []
    for c in sorted(C.CASES, key=lambda c: -len(c.values)):
        overrides, _ = C.overrides_of(c.values, data_dir)
        structure = tuple(o for o in overrides if validator._structural(o))
        if structure not in seen or len(sample) < 4:
            seen.add(structure)
            sample.append(overrides)
    assert len(seen) >= 4  # model=hf, optimizer=muon, data=hf, the additions
    for overrides in sample:
        assert validator.same_as_hydra(overrides), overrides


def test_the_cases_cover_every_allowed_pair_and_each_passes_validation(refused, validator, data_dir):
    pairs = C.allowed_pairs(refused, C.doc_rows(str(REPO)))
    assert len(pairs) > 300  # the matrix spans 13 settings
    missing = set(pairs) - C.covered(C.CASES)
    assert not missing, f"{len(missing)} allowed pairs meet in no case, e.g. {sorted(missing)[:5]}"
    names = [c.name for c in C.CASES]
    assert len(set(names)) == len(names)
    rows = C.doc_rows(str(REPO))
    for c in C.CASES:
        overrides, world = C.overrides_of(c.values, data_dir)
        assert world <= 4, c.name
        assert validator.problems(overrides, world) == [], c.name
        assert not any(r.refuses(k) for r in rows for k in C.pairs_of(c.values)), c.name
        assert c.reference in ("one process", C.TWO) or C.by_name(c.reference), (c.name, c.reference)


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


def _run_cases():
    for c in C.CASES:
        if c.quick or ALL:
            marks = [pytest.mark.xfail(strict=True, reason=c.known)] if c.known else []
            yield pytest.param(c.name, marks=marks)


@pytest.mark.parametrize("name", list(_run_cases()))
def test_the_case_equals_its_reference(name, data_dir, tmp_path):
    c = C.by_name(name)
    args, world = C.overrides_of(c.values, data_dir)
    got = _losses(args, world, tmp_path / "case", tmp_path)
    ref_args, ref_world = C.overrides_of(C.reference_values(c), data_dir)
    assert ref_world != world, "a reference on the same layout shows nothing"
    want = _losses(ref_args, ref_world, tmp_path / "reference", tmp_path)
    assert len(got) == len(want) == STEPS, (got, want)
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want), 1):
        # c.why says why the tolerance is what it is
        assert loss == pytest.approx(ref_loss, rel=c.tolerance), (step, got, want)
        if norm is not None and ref_norm is not None:
            assert norm == pytest.approx(ref_norm, rel=c.tolerance), (step, got, want)


def test_the_docs_name_the_opt_in_variable():
    assert "COMPOSITION_ALL=1" in (REPO / "docs" / "engine.md").read_text()
