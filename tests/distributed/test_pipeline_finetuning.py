"""Pipelines beyond pre-training, through `main.py`: supervised fine-tuning at pp=2 (packed
records, several documents a row, the loss on the response tokens only) trains like one process
on the same global batch, with and without LoRA adapters: losses, gradient norms, the validation
loss and every weight (the adapters' under LoRA) after 5 steps; and the safetensors export
(`checkpoint.export_safetensors`) of the pipeline is one process's.

The reference is one process accumulating 4 micro-batches of 2 rows a step, the pipeline's 4
microbatches. Tolerance 1e-5 as in test_pipeline.py: the same operations on the same rows; only
the order of float32 sums differs (the gradient norm summed per stage, then over stages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pipeline import BASE, _run, _same_as_reference

SFT = ["stage=fine_tuning", "data.seq_len=32", "model=debug", "model.args.n_layers=4"]


def _records(root: Path) -> list:
    """A byte-pair tokenizer and prompt/response records short enough to pack 2-4 to a row."""
    from framework.data.tokenizer import train_bpe

    texts = [f"def f{i}(a):\n    return a * {i} + {i % 7}\n" for i in range(80)]
    tok = train_bpe(texts, 300, str(root / "tok.json"))
    with open(root / "sft.jsonl", "w") as f:
        f.writelines(
            json.dumps({"prompt": f"def f{i}(a):\n", "response": f"    return a * {i} + {i % 7}\n"}) + "\n"
            for i in range(80)
        )
    return [
        f"finetune.train_file={root / 'sft.jsonl'}",
        f"finetune.tokenizer={root / 'tok.json'}",
        f"model.args.vocab_size={tok.vocab_size}",
    ]


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("pp_sft")
    common = BASE + SFT + _records(root)
    return root, common, _run(root, "one", ["cluster.nproc_per_node=1"], common)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_fine_tuning_at_pp2_equals_one_process(sft, tmp_path, schedule):
    root, common, reference = sft
    run = _run(
        tmp_path,
        schedule,
        ["cluster.nproc_per_node=2", "parallelism.pp=2", f"parallelism.pp_schedule={schedule}"],
        common,
    )
    _same_as_reference(run, reference)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_lora_fine_tuning_at_pp2_equals_one_process(tmp_path, sft, schedule):
    """LoRA under a pipeline: each stage carries its blocks' adapters (the base frozen), the
    checkpoint the adapters only; zbv's split backward computes the adapters' gradients in W.
    The adapters' B starts at zero, so a 0.01 learning rate moves them within 5 steps."""
    root, common, _ = sft
    lora = ["peft.lora.enabled=true", "peft.lora.targets=[q_proj,v_proj]", "optimizer.lr=0.01"]
    lora.append("checkpoint.export_safetensors=true")
    if schedule == "zbv":
        lora += ["parallelism.pp_split=[1,1,1,1]", "trainer.eval_interval=0"]
    reference = _run(root, f"one_lora_{schedule}", ["cluster.nproc_per_node=1"] + lora, common)
    pp = ["cluster.nproc_per_node=2", "parallelism.pp=2", f"parallelism.pp_schedule={schedule}"]
    run = _run(tmp_path, schedule, pp + lora, common)
    _same_as_reference(run, reference, validated=schedule != "zbv")
    _same_export(run, reference)


def _same_export(run: Path, reference: Path) -> None:
    """The export of a pipeline (every stage's tensors brought to rank 0 one at a time, the
    adapters folded in) holds one process's tensors: the same names, each within 1e-5 (the
    weights' own tolerance, see test_pipeline.py)."""
    import torch
    from safetensors import safe_open

    with (
        safe_open(str(run / "checkpoints" / "export" / "model.safetensors"), "pt") as mine,
        safe_open(str(reference / "checkpoints" / "export" / "model.safetensors"), "pt") as ref,
    ):
        assert sorted(mine.keys()) == sorted(ref.keys())  # noqa: SIM118 - a safe_open handle is not iterable
        for key in ref.keys():  # noqa: SIM118
            torch.testing.assert_close(mine.get_tensor(key), ref.get_tensor(key), atol=1e-5, rtol=0, msg=key)
    assert (run / "checkpoints" / "export" / "config.json").is_file()
