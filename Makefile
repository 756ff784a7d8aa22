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

# One process by default (CI's 2 cores). `make test TEST_WORKERS=4` on a bigger machine spreads
# whole files over pytest-xdist workers (a file's module fixtures, a trained checkpoint or a Slurm
# cluster, are built once). On 2 cores, 2 workers ran the suite in 30 min instead of ~40 but the
# two-node Slurm job once waited past its timeout beside the other worker's jobs, so not by default.
TEST_WORKERS ?= 0

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: venv
	$(BIN)/pip install --quiet -r requirements-bench.lock
	$(BIN)/python bench/engine.py $(ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
