"""`bench/upstream_fsdp2/run.py`, the runner of PyTorch's own FSDP2 test files against our engine:
its shim hands code written for torch's `fully_shard` our engine (in spawned ranks too), its CPU
adjustments make CUDA-only files take CPU ranks, and a bad folder is refused in one line."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import REPO

RUNNER = REPO / "bench" / "upstream_fsdp2" / "run.py"

# A stand-in for an upstream file: which engine its imports reach, in the test process and in
# two ranks that torch's multi-process test base spawns (the ranks see the same shim).
_FILE = textwrap.dedent(
    """
    import os
    import unittest

    import torch
    from torch.distributed.fsdp import fully_shard, FSDPModule, MixedPrecisionPolicy
    from torch.distributed._composable.fsdp import fully_shard as old_spelling
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
    from torch.testing._internal.common_fsdp import FSDPTest

    WANT = "framework." if os.environ["UPSTREAM_FSDP2_ENGINE"] == "ours" else "torch."


    class TestWhichEngine(FSDPTest):
        @property
        def world_size(self):
            return 2

        @skip_if_lt_x_gpu(2)
        def test_names_reach_the_engine(self):
            x = torch.ones(2, device="cuda")  # made CPU by the runner's adjustments
            assert x.device.type == "cpu"
            for obj in (fully_shard, FSDPModule, MixedPrecisionPolicy, old_spelling):
                assert obj.__module__.startswith(WANT), (obj, obj.__module__)
            model = torch.nn.Linear(4, 4)
            fully_shard(model)
            assert type(model).__module__.startswith(WANT) or isinstance(model, FSDPModule)


    class TestPlain(unittest.TestCase):
        def test_fails_on_purpose(self):
            raise AssertionError("a failure the table names")
    """
)


def test_runner_counts_each_engine_on_cpu_ranks(tmp_path):
    tests = tmp_path / "fsdp"
    tests.mkdir()
    (tests / "test_which_engine.py").write_text(_FILE)
    p = subprocess.run(
        [sys.executable, str(RUNNER), str(tests), "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if "::test_" in line}
    assert rows["TestWhichEngine::test_names_reach_the_engine"].count("passed") == 2, p.stdout
    assert "failed: " in rows["TestPlain::test_fails_on_purpose"], p.stdout
    assert "ours passes 1 of the 1 tests torch's fully_shard passes" in p.stdout, p.stdout


def test_runner_refuses_a_missing_folder(tmp_path):
    p = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp_path / "nope")], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("tests_dir="), p.stderr
