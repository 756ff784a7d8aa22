"""framework/job.py in one process: stage=dpo's reference is a second `build_job` (the policy's
layout, frozen) holding the weights the run started from, and stage=generate runs on a job that
builds no optimizer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank():
    from conftest import free_port

    from framework.runtime import Runtime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:  # the group goes with the test: a later in-process group of this worker could not start
        yield Runtime(0, 1, 0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def _config(overrides, run_dir):
    from framework.config import to_config
    from framework.config.compose import compose_config

    cfg = to_config(compose_config(overrides))
    cfg.run_dir = str(run_dir)
    return cfg


def _whole(module) -> dict:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.named_parameters()
    }


def test_the_reference_is_built_by_build_job_and_holds_the_imported_weights(tmp_path, one_rank):
    from conftest import TINY

    from framework.data.tokenizer import EOD, train_bpe
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    texts = [f"Q: what is {i} plus {j}? A: {i + j}{EOD}" for i in range(10) for j in range(10)]
    train_bpe(texts, 300, str(tmp_path / "tok.json"))
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(10):
            for j in range(4):
                record = {"prompt": f"Q: what is {i} plus {j}? A:", "chosen": f" {i + j}", "rejected": f" {i + j + 1}"}
                f.write(json.dumps(record) + "\n")
    base = [a for a in TINY if not a.startswith("data=")] + ["data=hf", "stage=dpo", "optimizer=sgd"]
    base += [f"data.paths=[{tmp_path / 'pairs.jsonl'}]", f"finetune.tokenizer={tmp_path / 'tok.json'}"]
    base += ["data.seq_len=24", "data.hf.valid_documents=4", "trainer.global_batch_size=4", "trainer.eval_interval=0"]
    base += ["cluster.nproc_per_node=1"]

    # two steps from the seeded initialisation, exported
    first = build_trainer(
        _config(base + ["trainer.max_steps=2", "checkpoint.export_safetensors=true"], tmp_path / "a"),
        one_rank,
        stage_of("dpo"),
    )
    seeded = _whole(first.objective.reference)
    assert first.fit() == 0
    trained = _whole(first.model)
    del first

    export = tmp_path / "a" / "checkpoints" / "export"
    second = build_trainer(
        _config(base + ["trainer.max_steps=1", f"checkpoint.init_from={export}"], tmp_path / "b"),
        one_rank,
        stage_of("dpo"),
    )
    reference = second.objective.reference
    assert reference is not second.model and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())
    assert type(reference) is type(second.model)  # the same layout: built and sharded as the policy
    second.objective.start()  # the starting weights: the import, before any resume
    mine = _whole(reference)
    assert mine.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(mine[name], value), name  # fp32 export and import: bit for bit
    assert any(not torch.equal(seeded[n], trained[n]) for n in trained)  # the import, not the seeded weights
    second.ckpt.close()
    second.stop.close()


def test_generate_and_evaluate_build_no_optimizer(tmp_path, one_rank, monkeypatch, stdlib_cache, capsys):
    """A checkpoint of a 2-step training job, then stage=generate and stage=evaluate on it: no
    optimizer is constructed (the probe counts every torch optimizer's construction, and sees the
    training job's); evaluate's tasks run on the job with the checkpoint's step."""
    from conftest import TINY

    from framework.stages import stage_of
    from framework.trainer import _train

    made = []
    real = torch.optim.Optimizer.__init__

    def counted(self, *args, **kwargs):
        made.append(type(self).__name__)
        real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counted)
    quiet = [a for a in TINY if not a.startswith("data=")] + [stdlib_cache, "cluster.nproc_per_node=1"]
    train = _config(quiet + ["trainer.max_steps=2", "trainer.eval_interval=0", "checkpoint.save_final=true"], tmp_path)
    assert _train(train, one_rank, stage_of("training")) == 0
    assert made, "the probe sees the training job's optimizer"
    made.clear()
    step = tmp_path / "checkpoints" / "step_00000002"
    overrides = quiet + ["stage=generate", f"checkpoint.resume={step}", 'generate.prompts=["def add(a, b):"]']
    generate = _config(overrides + ["generate.max_new_tokens=4"], tmp_path / "g")
    assert _train(generate, one_rank, stage_of("generate")) == 0
    assert made == []
    assert "generating from step 2" in capsys.readouterr().err

    import framework.evaluate
    from framework.job import Job

    ran = []  # lm-eval itself is tests/integration/test_evaluate.py's
    monkeypatch.setattr(
        framework.evaluate, "run_tasks", lambda job, tasks, step, trackers: ran.append((job, tasks, step))
    )
    evaluate = _config(
        quiet + ["stage=evaluate", f"checkpoint.resume={step}", "evaluate.tasks=[a_task]"], tmp_path / "e"
    )
    assert _train(evaluate, one_rank, stage_of("evaluate")) == 0
    assert made == []
    assert [(type(job), tasks, at) for job, tasks, at in ran] == [(Job, ["a_task"], 2)]
