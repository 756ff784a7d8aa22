#!/usr/bin/env bash
# Five 2-rank runs in a row under `torchrun --max-restarts=2 --rdzv-backend=c10d`, each with one rank
# SIGKILLed at step 5 (and, after that restart, the other raising an OSError at step 7); each must
# finish, and its losses after the restarts must equal an uninterrupted
# run's (1e-6). About 5 x 40 s on 2 CPU cores. Run from the repository root:
#     tests/reliability/restart_five_times.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
FRAMEWORK_TEST_RESTART_RUNS="${1:-5}" exec .venv/bin/python -m pytest -q -s -p no:cacheprovider \
    tests/reliability/test_failures.py -k restarts_and_resumes_exactly
