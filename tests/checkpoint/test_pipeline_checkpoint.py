"""Checkpoints of a pipeline: written by every stage (each rank its stages' parameters and
optimizer state, under the whole model's names), resumed at another pipeline degree.

The uninterrupted run is pp=2 x dp_shard=2 on 4 ranks, 6 steps, a checkpoint at 3. Its step-3
checkpoint resumes at pp=1 x dp_shard=4 and at pp=4, and both log the uninterrupted run's losses
for steps 4-6 within 1e-5: the same 8 samples a step ([Note: global sample order] in
framework/data/loader.py), summed in another order (per-rank micro-batches, 2 or 4
data-parallel ranks, 1, 2 or 4 stages), float32 rounding of a loss near 5 over 3 AdamW steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, read_metrics, run_main

COMMON = TINY + [
    "model.args.n_layers=4",  # one layer per stage at pp=4
    "trainer.eval_interval=0",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=8",
    "trainer.max_steps=6",
    "cluster.nproc_per_node=4",
]
TOLERANCE = 1e-5  # see the module docstring


def _run(root: Path, name: str, overrides: list) -> Path:
    run = root / name
    out = run_main(COMMON + overrides + [f"hydra.run.dir={run}"], root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run


def _losses(run: Path) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(run) if "loss" in row}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pp_ckpt")
    return _run(root, "source", ["parallelism.pp=2", "parallelism.dp_shard=2", "checkpoint.interval=3"])


def test_every_stage_writes_its_parameters_under_the_whole_models_names(source):
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(source / "checkpoints" / "step_00000003")).read_metadata()
    model = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    assert {"model.tok_embeddings.weight", "model.norm.weight", "model.output.weight"} <= model  # first, last stage
    assert {f"model.layers.{i}.attention.wq.weight" for i in range(4)} <= model  # both stages' blocks
    optim = {k for k in meta.state_dict_metadata if k.startswith("optim.state.") and k.endswith(".exp_avg")}
    assert "optim.state.layers.3.feed_forward.w2.weight.exp_avg" in optim and len(optim) == len(model)


@pytest.mark.parametrize("layout", [[], ["parallelism.pp=4"]], ids=["pp1_dp4", "pp4"])
def test_resume_at_another_pipeline_degree(source, tmp_path, layout):
    resume = f"checkpoint.resume={source / 'checkpoints' / 'step_00000003'}"
    run = _run(tmp_path, "resumed", layout + [resume])
    want, got = _losses(source), _losses(run)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert abs(got[step] - want[step]) <= TOLERANCE, (step, got[step], want[step])


def test_an_export_initialises_a_pipeline_as_one_process(tmp_path):
    """checkpoint.init_from at pp=2: each rank reads its own stages' tensors from the safetensors
    export, and every tensor of it is used by some rank (else the import is refused, as at pp=1);
    the first step's loss is the one-process import's (1e-5: the order of sums, as above)."""
    one_rank = ["cluster.nproc_per_node=1", "trainer.max_steps=1"]
    export = _run(tmp_path, "export", one_rank + ["checkpoint.save_final=true", "checkpoint.export_safetensors=true"])
    init = [f"checkpoint.init_from={export / 'checkpoints' / 'export'}", "trainer.max_steps=1"]
    one = _run(tmp_path, "one", init + ["cluster.nproc_per_node=1"])
    pp = _run(tmp_path, "pp", init + ["cluster.nproc_per_node=2", "parallelism.pp=2"])
    assert abs(_losses(pp)[1] - _losses(one)[1]) <= TOLERANCE
    assert _losses(one)[1] != _losses(export)[1]  # the imported weights, one step on
