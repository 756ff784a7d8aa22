"""The harness's records of cases run in a spawn: a case that raised in a rank fails its test with
that rank's traceback as the message ([Note: one spawn, many cases, each failing with its own
traceback] in harness.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from tests.distributed.harness import passed, recorded, records_of


def _fails_on_rank_1(rank: int) -> dict:
    if rank == 1:
        moved = 0.0
        assert moved > 0.5, f"rank {rank}: the weights did not move"
    return {"moved": 1.0}


def test_a_record_that_raised_fails_the_test_with_its_traceback():
    ok, raised = recorded(_fails_on_rank_1, 0), recorded(_fails_on_rank_1, 1)
    records = records_of([{"a": ok, "b": ok}, {"a": ok, "b": raised}])
    assert passed(records["a"]) == {"moved": 1.0}
    with pytest.raises(pytest.fail.Exception) as failed:
        passed(records["b"])
    message = str(failed.value)
    assert message.startswith("rank 0 of 1: Traceback (most recent call last):\n"), message
    assert '    assert moved > 0.5, f"rank {rank}: the weights did not move"\n' in message, message
    assert "\nAssertionError: rank 1: the weights did not move\n" in message, message
    assert failed.value.pytrace is False


MODULE = """
import pytest
import torch.distributed as dist
from tests.distributed.harness import passed, records_of, recorded, run_ranks


def _case(rank):
    assert dist.get_rank() != 1, "the planted failure of rank 1"
    return {"fine": True}


def _worker(rank, world):
    return {"case": recorded(_case, rank), "other": recorded(lambda: {"fine": True})}


@pytest.fixture(scope="module")
def results():
    return records_of(run_ranks(_worker, 2, timeout_s=120))


def test_case(results):
    assert passed(results["case"])["fine"]


def test_other(results):
    assert passed(results["other"])["fine"]
"""


def test_a_case_failing_in_one_rank_of_a_spawn_shows_that_ranks_traceback(tmp_path):
    """Through pytest: of two cases in one spawn of 2 ranks, the one that raised on rank 1 fails
    with rank 1's assertion and traceback as its message; the other passes."""
    (tmp_path / "test_planted").with_suffix(".py").write_text(MODULE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "1 failed, 1 passed" in out.stdout, out.stdout[-3000:]
    failure = out.stdout[out.stdout.index("_ test_case _") : out.stdout.index("short test summary")]
    assert "rank 1 of 2: Traceback (most recent call last):" in failure, failure
    assert 'assert dist.get_rank() != 1, "the planted failure of rank 1"' in failure, failure
    assert "AssertionError: the planted failure of rank 1" in failure, failure
    assert "def passed" not in failure and "harness.py" not in failure.split("Traceback")[0], failure
