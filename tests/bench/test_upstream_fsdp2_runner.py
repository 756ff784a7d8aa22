"""`bench/upstream_fsdp2/run.py`, the runner of PyTorch's own FSDP2 test files against our engine:
its shim hands code written for torch's `fully_shard` our engine (in spawned ranks too), its CPU
adjustments make CUDA-only files take CPU ranks, and a bad folder is refused in one line."""

from __future__ import annotations

import shutil
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


def test_the_shim_hands_spawned_ranks_our_engine_on_cpu(tmp_path):
    """One run under `--engine ours` (torch's engine is the same command with `torch`): the
    spawned ranks' imports reach our engine, the CPU adjustments let the CUDA-written test run."""
    tests = tmp_path / "fsdp"
    tests.mkdir()
    (tests / "test_which_engine.py").write_text(_FILE)
    p = subprocess.run(
        [sys.executable, str(RUNNER), str(tests), "--engine", "ours", "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {line.split("|")[1].strip(): line for line in p.stdout.splitlines() if "::test_" in line}
    assert "| passed |" in rows["TestWhichEngine::test_names_reach_the_engine"], p.stdout
    assert "failed: AssertionError: a failure the table names" in rows["TestPlain::test_fails_on_purpose"], p.stdout


def test_cpu_adjustments_and_the_count(tmp_path):
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import run
    finally:
        sys.path.remove(str(RUNNER.parent))
    src = tmp_path / "src"
    src.mkdir()
    (src / "test_a.py").write_text(
        'm = init_device_mesh("cuda", (2,))\nx = torch.randn(2, device="cuda").cuda()\n@skip_if_lt_x_gpu(2)\n'
    )
    out = run.materialise(src, rewrite=True)
    try:
        assert (out / "test_a.py").read_text() == (
            'm = init_device_mesh("cpu", (2,))\nx = torch.randn(2, device="cpu").cpu()\n'
            "@skip_if_lt_x_gpu(2, allow_cpu=True)\n"
        )
        assert not str(out).startswith(str(REPO))  # the copies never land in the repository
    finally:
        shutil.rmtree(out)
    results = {
        "torch": {"A::a": ("passed", ""), "A::b": ("passed", ""), "A::c": ("failed", "x")},
        "ours": {"A::a": ("passed", ""), "A::b": ("failed", "y"), "A::c": ("passed", "")},
    }
    table = run.summarise(results)
    assert "| A::b | passed | failed: y |" in table
    assert table.endswith("ours passes 1 of the 2 tests torch's fully_shard passes")


def test_runner_refuses_a_missing_folder(tmp_path):
    p = subprocess.run(
        [sys.executable, str(RUNNER), str(tmp_path / "nope")], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("tests_dir="), p.stderr
