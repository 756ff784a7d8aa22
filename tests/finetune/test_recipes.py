"""The recipes end to end through `python main.py`, on tiny settings: the digits CNN learns, and a
LoRA fine-tune starts from an export, checkpoints its adapters only and exports a plain model."""

from __future__ import annotations

import json

import torch
from conftest import read_metrics, run_main
from safetensors import safe_open

QUIET = ["trainer.progress_bar=false", "logging.tensorboard=false", "trainer.sample_tokens=0"]


def test_digits_cnn_learns(tmp_path):
    out = run_main(
        ["experiment=digits_cnn", "trainer.max_steps=40", "trainer.eval_interval=40", f"hydra.run.dir={tmp_path}/run"]
        + QUIET,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    final = [m for m in read_metrics(tmp_path / "run") if "val_acc" in m][-1]
    # 40 steps (~2 epochs) reach ~0.95 on the 359 held-out images; chance is 0.1. The full recipe
    # (200 steps) reaches >= 0.98, see docs/fine_tuning.md.
    assert final["step"] == 40 and final["val_acc"] > 0.6, final


def test_model_digits_cnn_with_data_digits_trains(tmp_path):
    """`model=digits_cnn data=digits` (the README's config table), without the experiment: the
    group option composes and the CNN trains on the digits with the trainer's own defaults."""
    run = tmp_path / "run"
    out = run_main(
        ["model=digits_cnn", "data=digits", "trainer.max_steps=30", "trainer.eval_interval=30", f"hydra.run.dir={run}"]
        + ["trainer.progress_bar=false", "logging.tensorboard=false", "logging.loss_plot=false"]
        + ["checkpoint.save_final=false"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(run)
    losses = [m["loss"] for m in metrics if "loss" in m]
    final = [m for m in metrics if "val_acc" in m][-1]
    # 30 steps of 16 images (a third of an epoch) take the test accuracy from chance (0.1) to
    # 0.88 measured, the training loss from 2.45 to 0.25.
    assert len(losses) == 30 and losses[-1] < losses[0], losses
    assert final["step"] == 30 and final["val_acc"] > 0.5, final


def _files(tmp_path):
    from framework.data.tokenizer import train_bpe

    texts = [f"def f{i}(a):\n    return a + {i}\n" for i in range(50)]
    tok = train_bpe(texts, 300, str(tmp_path / "tok.json"))
    with open(tmp_path / "sft.jsonl", "w") as f:
        f.writelines(
            json.dumps({"prompt": f"def f{i}(a):\n", "response": f"    return a + {i}\n"}) + "\n" for i in range(24)
        )
        f.write(
            json.dumps(
                {"messages": [{"role": "user", "content": "def g():"}, {"role": "assistant", "content": "    pass"}]}
            )
            + "\n"
        )
    return tok.vocab_size


def test_lora_fine_tuning_from_an_export(tmp_path):
    vocab = _files(tmp_path)
    pre = run_main(
        [
            "model=debug",
            "data=synthetic",
            f"model.args.vocab_size={vocab}",
            "trainer.max_steps=2",
            "checkpoint.export_safetensors=true",
            f"hydra.run.dir={tmp_path}/pre",
        ]
        + QUIET,
        tmp_path,
    )
    assert pre.returncode == 0, pre.stderr[-3000:]
    base_dir = tmp_path / "pre" / "checkpoints" / "export"
    ft = run_main(
        [
            "model=debug",
            "stage=fine_tuning",
            f"finetune.train_file={tmp_path}/sft.jsonl",
            f"finetune.tokenizer={tmp_path}/tok.json",
            f"checkpoint.init_from={base_dir}",
            "peft.lora.enabled=true",
            "peft.lora.targets=[q_proj,v_proj]",
            "trainer.max_steps=4",
            "trainer.eval_interval=4",
            "optimizer.lr=0.01",
            "data.seq_len=32",
            "checkpoint.export_safetensors=true",
            f"hydra.run.dir={tmp_path}/ft",
        ]
        + QUIET,
        tmp_path,
    )
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert "LoRA rank 8 on 4 layers" in ft.stdout + ft.stderr
    metrics = read_metrics(tmp_path / "ft")
    assert "val_loss" in metrics[-1]
    # The checkpoint holds the adapters only (and their optimizer state).
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "ft" / "checkpoints" / "step_00000004")).read_metadata()
    model_keys = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    assert model_keys == {
        f"model.layers.{i}.attention.{w}.lora_{ab}" for i in (0, 1) for w in ("wq", "wv") for ab in ("a", "b")
    }
    # The export is a plain Llama: the base's tensor names, the adapters folded into q and v only.
    with (
        safe_open(str(base_dir / "model.safetensors"), "pt") as base,
        safe_open(str(tmp_path / "ft" / "checkpoints" / "export" / "model.safetensors"), "pt") as tuned,
    ):
        assert set(base.keys()) == set(tuned.keys())
        changed = {k for k in base.keys() if not torch.equal(base.get_tensor(k), tuned.get_tensor(k))}  # noqa: SIM118
    assert changed == {f"model.layers.{i}.self_attn.{w}.weight" for i in (0, 1) for w in ("q_proj", "v_proj")}


def test_t5_docstrings_trains_then_fine_tunes_from_its_export(tmp_path):
    vocab = _files(tmp_path)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"def f{i}(a):\n    return a + {i}\n", "response": f"Add {i}."}) + "\n"
            for i in range(16)
        )
    )
    tiny = [
        "experiment=t5_docstrings",
        f"model.config.vocab_size={vocab}",
        "model.config.d_model=32",
        "model.config.d_ff=64",
        "model.config.d_kv=8",
        "model.config.num_layers=1",
        "model.config.num_decoder_layers=1",
        "finetune.dataset=",
        f"finetune.train_file={pairs}",
        f"finetune.tokenizer={tmp_path}/tok.json",
        "data.seq_len=32",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=4",
        "trainer.eval_iters=1",
    ] + QUIET
    first = run_main(
        tiny + ["trainer.max_steps=2", "trainer.eval_interval=2", f"hydra.run.dir={tmp_path}/t5"], tmp_path
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "val_exact_match" in read_metrics(tmp_path / "t5")[-1]
    assert "expected:  Add" in first.stdout + first.stderr and "generated:" in first.stdout + first.stderr
    again = run_main(
        tiny
        + [
            "trainer.max_steps=1",
            "trainer.eval_interval=1",
            "checkpoint.export_safetensors=false",
            f"checkpoint.init_from={tmp_path}/t5/checkpoints/export",
            f"hydra.run.dir={tmp_path}/t5_again",
        ],
        tmp_path,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "initialised" in again.stderr
    # Starting from the export, the first validation loss is the trained model's, not a fresh one's.
    fresh_first = read_metrics(tmp_path / "t5")[0]["loss"]
    assert read_metrics(tmp_path / "t5_again")[0]["loss"] < fresh_first
