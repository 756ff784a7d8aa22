"""Checkpoints of the newer combinations resume on plain sharding and back, through `main.py`.

Each combination is a set of the composition matrix's values (tests/integration/composition.py:
the same overrides, debug model of 4 layers, SGD with momentum, 8 sequences a step). Its plain
twin keeps what the job is (LoRA, float8, SFT) and drops the layout for dp_shard=2. Both run 4
steps uninterrupted with a checkpoint at step 2; then the combination's step-2 checkpoint resumes
on the plain layout, and the plain one's on the combination, and each resumed run logs its
source's losses and gradient norms for steps 3 and 4 (step 3 reads the restored weights, step 4
also the restored momentum and data position: a resume that drops the momentum was measured
3.2e-4 off in step 4's loss and 1.2e-2 in its gradient norm on LoRA x tp).

Tolerance: 1e-5 relative where the same fp32 arithmetic runs, summed in another order across
ranks (measured 1.4e-7 at most); float8 with tp 1e-3 (measured 6.7e-5, a gradient norm): a
forward's e4m3 scales are taken over the rows and the pieces the layout gives it, so the two
layouts round a few elements differently ([Note: float8 under tensor parallelism] in
framework/distributed/float8.py).

Two combinations run by default (2 ranks each, 8 jobs, ~2 min together on the loaded 2-core
machine); all six with COMPOSITION_ALL=1 (23 jobs, ~5 min), as the composition matrix's opt-in
cases. "hf x sp" is a Hugging Face Llama (`model=hf`) at tp=2 with sequence parallel, whose
decoder layers hold 1/tp of the stream ([Note: where a Hugging Face decoder's sequence is cut]
in framework/models/hf/sequence_parallel.py), each tp rank saving its pieces of the split weights
(its 4 jobs took 55 s on the loaded machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import read_metrics, run_main

from tests.integration import composition as C

ALL = os.environ.get("COMPOSITION_ALL") == "1"
STEPS, SAVED = 4, 2
# SGD's rate: steps large enough that a lost momentum shows (the matrix's 0.05 barely moves the
# tiny model); float8 keeps 0.05, as its e4m3 roundings grow with the steps (at 1.0 its two
# layouts' uninterrupted runs were measured 21% apart by step 4).
LR, F8_LR = 1.0, 0.05
FP32 = 1e-5  # see the module docstring
F8 = 1e-3

LAYOUT = ("dp_shard", "dp_replicate", "tp", "sp", "cp", "pp")

# name: (the combination's matrix values, tolerance, run by default)
COMBINATIONS = {
    "lora x tp": ({"tp": "2", "lora": "on"}, FP32, True),
    "sft under pp": ({"pp": "1f1b", "stage": "sft"}, FP32, True),
    "float8 x tp": ({"tp": "2", "float8": "on"}, F8, False),
    "cp x hsdp": ({"dp_replicate": "2", "cp": "2"}, FP32, False),
    "lora under pp": ({"pp": "gpipe", "lora": "on"}, FP32, False),
    "hf x sp": ({"sp": "on", "model": "hf"}, FP32, False),
}


def _plain(values: Dict[str, str]) -> Dict[str, str]:
    """The same job on dp_shard=2, no other layout."""
    return {**{k: v for k, v in values.items() if k not in LAYOUT}, "dp_shard": "2"}


def _args(values: Dict[str, str], data_dir: Path) -> List[str]:
    args, world = C.overrides_of(values, str(data_dir))
    args = [a for a in args if not a.startswith("cluster.nproc_per_node=")]
    lr = F8_LR if values.get("float8") == "on" else LR
    return args + [f"cluster.nproc_per_node={world}", f"trainer.max_steps={STEPS}", f"optimizer.lr={lr}"]


def _run(values: Dict[str, str], data_dir: Path, run: Path, extra: List[str]) -> Dict[int, tuple]:
    out = run_main([*_args(values, data_dir), *extra, f"hydra.run.dir={run}"], run.parent, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run) if "loss" in r and "step" in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume_layouts_data")
    C.write_data(str(root))
    return root


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """Runs of 4 steps with a checkpoint at step 2, one per set of values, made once:
    {values: (run dir, losses by step)}."""
    made = {}

    def get(values: Dict[str, str]):
        key = tuple(sorted(values.items()))
        if key not in made:
            run = tmp_path_factory.mktemp("uninterrupted") / "run"
            made[key] = (run, _run(values, data_dir, run, [f"checkpoint.interval={SAVED}"]))
        return made[key]

    return get


def _cases():
    for name, (_, _, quick) in COMBINATIONS.items():
        if quick or ALL:
            yield pytest.param(name, id=name.replace(" ", "_"))


@pytest.mark.parametrize("name", list(_cases()))
def test_a_checkpoint_resumes_on_plain_sharding_and_back(name, uninterrupted, data_dir, tmp_path):
    values, tolerance, _ = COMBINATIONS[name]
    plain = _plain(values)
    directions = {"to_plain": (values, plain), "to_combination": (plain, values)}
    for label, (source, target) in directions.items():
        run, want = uninterrupted(source)
        assert sorted(want) == list(range(1, STEPS + 1)), want
        resume = f"checkpoint.resume={run / 'checkpoints' / f'step_{SAVED:08d}'}"
        got = _run(target, data_dir, tmp_path / label, [resume, "checkpoint.save_final=false"])
        assert sorted(got) == list(range(SAVED + 1, STEPS + 1)), (label, got)
        for step in got:  # the tolerance: see the module docstring
            assert got[step] == pytest.approx(want[step], rel=tolerance), (label, step, got, want)
