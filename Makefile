# The two commands of the README: `make run` and `make test`. Both go through `make venv`,
# which creates .venv once and reuses it (re-installing only when the pins change).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv run test lint bench clean

venv: $(STAMP)

# torch is pinned first and on its own: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): requirements.lock requirements-tools.lock requirements-test.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.lock -r requirements-tools.lock -r requirements-test.lock
	touch $(STAMP)

run: venv
	$(BIN)/python main.py $(ARGS)

# Two pytest-xdist workers (CI's 2 cores) over whole files (a file's module fixtures, a trained
# checkpoint, are built once), then, alone, the tests whose bounds are wall-clock times (Slurm jobs
# and a pre-emption, two nodes' rendezvous; `serial` in tests/conftest.py): beside another worker's
# jobs they could overrun. `make test TEST_WORKERS=0`: one process.
# Measured on 2 cores (2026-12-07, an AMD EPYC, 1407 tests, nothing else running, `.ci/run` on a
# fresh clone of abaa312): first phase 1238 s, serial phase 109 s, the whole of .ci/run 1542 s
# (of 7e15871, 1334 tests: 1010 s; of e51487c, 2026-12-06, 1097 tests: 645 s + 54 s); identical
# runs differ by ~45 s, days by more; 3 workers made the first phase slower (1011 s, an older suite).
TEST_WORKERS ?= 2
# Each phase lists its skipped tests with their reasons (-rs; -rfE: failures and errors, pytest's
# default) and writes a JUnit report here; .ci/run ends with both phases' skips (.ci/skips.py).
TEST_REPORTS ?= outputs/test-reports

test: venv
	rm -f $(TEST_REPORTS)/parallel.xml $(TEST_REPORTS)/serial.xml
	$(BIN)/python -m pytest -q -rfEs --junitxml=$(TEST_REPORTS)/parallel.xml -n $(TEST_WORKERS) --dist loadfile -m "not serial" tests $(ARGS)
	$(BIN)/python -m pytest -q -rfEs --junitxml=$(TEST_REPORTS)/serial.xml -m serial tests $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/pip install --quiet -r requirements-bench.lock
	$(BIN)/python bench/engine.py $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
