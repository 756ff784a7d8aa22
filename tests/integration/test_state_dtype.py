"""`python main.py optimizer.state_dtype=bf16` with optimizer=adamw and optimizer=muon on 2 ranks:
it trains like fp32 state within a measured tolerance, its checkpoint holds bf16 state, and a resume
repeats the run bit for bit on 2 ranks and loads on 1 ([Note: bf16 optimizer state and its
rounding] in framework/optim/lowp.py)."""

from __future__ import annotations

import collections

import pytest
from conftest import TINY, read_metrics, run_main

STEPS = 20
JOB = TINY + [
    "trainer.eval_interval=0",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    f"trainer.max_steps={STEPS}",
]
# Tolerances, measured with these runs (model=debug, 2 ranks, synthetic data, the default
# schedules; `pytest tests/integration/test_state_dtype.py --basetemp=DIR`, then the metrics.jsonl
# of each run compared): over the 20 steps, bf16 state's loss differed from fp32 state's by at most
# 7.2e-5 (adamw) and 1.0e-4 (muon), while the loss fell by 0.96 in both (since bf16 state's step
# takes the correctly rounded square root; 5.1e-5 and 1.9e-4 before). Each state element carries
# an unbiased rounding error of under one bf16 gap (2^-8 relative), so the updates differ by a
# fraction of a per cent and the loss by far less; Muon's differs more because its bfloat16
# Newton-Schulz turns small differences in the momentum into whole bf16 units of the update. The
# bounds are 3-8x the measured differences.
CLOSE = {"adamw": 2e-4, "muon": 8e-4}
# Resuming on 1 rank sums each gradient in another order (~1e-7 relative), and a state value that
# differs in its last fp32 bit draws another rounding (the hash reads the value's bits: [Note: bf16
# optimizer state and its rounding]), so the two runs part by whole bf16 gaps in a few elements:
# measured 5.1e-5 (muon; 6.8e-5 before the correctly rounded root; adamw: 1.7e-5, when this test
# also ran it) in the loss over the 10 steps after the resume.
RESUME_TOL = 3e-4


def _losses(run) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run) if "loss" in row}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per optimizer: 20 steps with fp32 state, 20 with bf16 state (checkpoint at step 10), and the
    bf16 run resumed from step 10 on 2 ranks; Muon's also on 1 rank (AdamW's state loads through the
    same code: the engine's state dict, then `recast_state_`)."""
    out = {}
    for name in ("adamw", "muon"):
        tmp = tmp_path_factory.mktemp(name)
        base = JOB + [f"optimizer={name}"]
        got = {}
        jobs = {
            "fp32": ["cluster.nproc_per_node=2"],
            "bf16": ["cluster.nproc_per_node=2", "optimizer.state_dtype=bf16", "checkpoint.interval=10"],
        }
        for ranks in (2, 1) if name == "muon" else (2,):
            jobs[f"resumed{ranks}"] = [
                f"cluster.nproc_per_node={ranks}",
                "optimizer.state_dtype=bf16",
                f"checkpoint.resume={tmp}/bf16/checkpoints/step_00000010",
            ]
        for key, args in jobs.items():
            res = run_main(base + args + [f"hydra.run.dir={tmp}/{key}"], tmp)
            assert res.returncode == 0, (name, key, res.stderr[-3000:])
            got[key] = _losses(tmp / key)
        got["checkpoint"] = tmp / "bf16" / "checkpoints" / "step_00000010"
        out[name] = got
    return out


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_state_trains_like_fp32_state(runs, name):
    fp32, bf16 = runs[name]["fp32"], runs[name]["bf16"]
    assert sorted(fp32) == sorted(bf16) == list(range(1, STEPS + 1))
    assert fp32[STEPS] < fp32[1] - 0.5 and bf16[STEPS] < bf16[1] - 0.5, (fp32, bf16)
    assert fp32 != bf16  # the state really differs
    worst = max(abs(fp32[s] - bf16[s]) for s in fp32)
    assert worst < CLOSE[name], (name, worst)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_checkpoint_holds_bf16_state(runs, name):
    """The checkpoint's optimizer tensors, read from its metadata: every moment and momentum buffer
    is bfloat16 (half the bytes of fp32 state), the step counters float32 scalars."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(runs[name]["checkpoint"])).read_metadata()
    kinds = collections.Counter()
    for key, value in meta.state_dict_metadata.items():
        if key.startswith("optim") and hasattr(value, "properties"):
            kinds[(key.rsplit(".", 1)[-1], str(value.properties.dtype).replace("torch.", ""))] += 1
    want = {("step", "float32"): 21}  # model=debug: 21 parameters
    if name == "adamw":
        want.update({("exp_avg", "bfloat16"): 21, ("exp_avg_sq", "bfloat16"): 21})
    else:  # Muon's 14 block matrices, AdamW's 7 others (embeddings, norms, head)
        want.update({("momentum_buffer", "bfloat16"): 14, ("exp_avg", "bfloat16"): 7, ("exp_avg_sq", "bfloat16"): 7})
    assert dict(kinds) == want


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_state_resumes_exactly_and_at_another_world_size(runs, name):
    want, again = runs[name]["bf16"], runs[name]["resumed2"]
    assert sorted(again) == list(range(11, STEPS + 1))
    assert [again[s] for s in again] == [want[s] for s in again]  # bit for bit
    if name == "muon":
        one = runs[name]["resumed1"]
        assert sorted(one) == list(range(11, STEPS + 1))
        worst = max(abs(one[s] - want[s]) for s in one)
        assert worst < RESUME_TOL, (name, worst)


def test_bf16_state_under_torchs_engine_resumes_exactly(tmp_path):
    """parallelism.engine=torch (FSDP2's DTensors): AdamW with bf16 state trains, saves bf16 moments
    and resumes from step 4 bit for bit."""
    from torch.distributed.checkpoint import FileSystemReader

    base = JOB + ["cluster.nproc_per_node=2", "parallelism.engine=torch", "optimizer.state_dtype=bf16"]
    base = [a for a in base if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=6"]
    src = run_main(base + ["checkpoint.interval=4", f"hydra.run.dir={tmp_path}/src"], tmp_path)
    assert src.returncode == 0, src.stderr[-3000:]
    ckpt = tmp_path / "src" / "checkpoints" / "step_00000004"
    again = run_main(base + [f"checkpoint.resume={ckpt}", f"hydra.run.dir={tmp_path}/again"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = _losses(tmp_path / "src"), _losses(tmp_path / "again")
    assert sorted(got) == [5, 6] and [got[s] for s in got] == [want[s] for s in got]
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    moments = {str(v.properties.dtype) for k, v in meta.items() if k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")}
    assert moments == {"torch.bfloat16"}


def test_resume_with_another_state_dtype_is_refused(runs, tmp_path):
    """A checkpoint resumes with the state dtype it was saved in: another is refused in one line
    naming the field, before any step (Muon's matrices have a step counter in bf16 only)."""
    ckpt = runs["muon"]["checkpoint"]
    args = JOB + ["optimizer=muon", "cluster.nproc_per_node=2", f"checkpoint.resume={ckpt}"]
    out = run_main(args + [f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    line = (
        f"checkpoint.resume: {ckpt} was saved with optimizer.state_dtype=bf16; resume with "
        "optimizer.state_dtype=bf16, or start afresh from its weights with checkpoint.resume=none and "
        "checkpoint.init_from"
    )
    assert line in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not _losses(tmp_path / "run")
