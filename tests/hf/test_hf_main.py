"""`python main.py model=hf model.path=<save_pretrained dir> ...` trains on 2 ranks and exports a
directory that transformers' `from_pretrained` loads unchanged, with the trained logits; the task
comes from the directory's config.json (GPT-2, T5, a BERT classifier) unless model.task says."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_main

GPT2 = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 128,
    "n_positions": 64,
    "bos_token_id": 1,
    "eos_token_id": 1,
}
T5 = {
    "model_type": "t5",
    "num_layers": 2,
    "num_decoder_layers": 2,
    "d_model": 32,
    "d_kv": 8,
    "num_heads": 4,
    "d_ff": 64,
    "vocab_size": 128,
    "relative_attention_num_buckets": 8,
    "decoder_start_token_id": 0,
}
TASK_CLASS = {"causal_lm": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM"}


def _trained_state(checkpoint_dir) -> dict:
    """The model's weights in a DCP checkpoint, read on one process without a process group."""
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.contents import TensorsOnlyLoadPlanner

    meta = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    state = {
        k[len("model.") :]: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.")
    }
    dcp.load({"model": state}, checkpoint_id=str(checkpoint_dir), planner=TensorsOnlyLoadPlanner(), no_dist=True)
    return state


@pytest.mark.parametrize(
    "config, task, engine", [(GPT2, "causal_lm", "native"), (T5, "seq2seq", "torch")], ids=["gpt2-native", "t5-torch"]
)
def test_a_save_pretrained_directory_trains_and_exports_for_from_pretrained(config, task, engine, tmp_path):
    import transformers
    from transformers import AutoConfig, AutoModel

    auto = getattr(transformers, TASK_CLASS[task])
    source = tmp_path / "source"
    torch.manual_seed(0)
    data = dict(config)
    auto.from_config(AutoConfig.for_model(data.pop("model_type"), **data)).save_pretrained(source)
    run = tmp_path / "run"
    out = run_main(
        [
            "model=hf",
            f"model.path={source}",  # no model.task: config.json's architectures say it
            "data=synthetic",
            "data.seq_len=16",
            "trainer.max_steps=5",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
            "checkpoint.export_safetensors=true",
            f"parallelism.engine={engine}",
            "trainer.progress_bar=false",
            "logging.tensorboard=false",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "initialised" in out.stderr and str(source) in out.stderr, out.stderr[-2000:]  # read model.path
    export = run / "checkpoints" / "export"

    # The export loads into the base class and the task class with nothing missing or left over.
    base, info = AutoModel.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    loaded, info = auto.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info

    # ... and computes what the trained sharded model computes (its final checkpoint, on one process).
    trained = _trained_state(run / "checkpoints" / "step_00000005")
    ours = auto.from_config(AutoConfig.from_pretrained(export))
    ours.load_state_dict(trained)
    ours_base = AutoModel.from_config(AutoConfig.from_pretrained(export))
    prefix = ours.base_model_prefix + "."
    base_keys = set(ours_base.state_dict())
    ours_base.load_state_dict(
        {k.removeprefix(prefix): v for k, v in trained.items() if (k.removeprefix(prefix)) in base_keys}
    )
    source_model = auto.from_pretrained(source)
    ids = torch.randint(128, (2, 12), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, **({"decoder_input_ids": ids[:, :5]} if task == "seq2seq" else {})}
    for model in (base, loaded, ours, ours_base, source_model):
        model.eval()
    with torch.no_grad():
        assert (loaded(**inputs).logits - ours(**inputs).logits).abs().max() <= 1e-5  # fp32, same weights: 0
        hidden = base(**inputs).last_hidden_state
        assert (hidden - ours_base(**inputs).last_hidden_state).abs().max() <= 1e-5
        # Training changed the weights read from model.path (else the comparison above proves little).
        assert (source_model(**inputs).logits - ours(**inputs).logits).abs().max() > 1e-4


BERT = {
    "model_type": "bert",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "num_labels": 3,
}


def _bert_dir(path, head: str):
    import transformers
    from transformers import AutoConfig

    data = dict(BERT)
    torch.manual_seed(0)
    getattr(transformers, head)(AutoConfig.for_model(data.pop("model_type"), **data)).save_pretrained(path)
    return path


def test_a_bert_classifier_trains_with_its_own_task_and_labels(tmp_path):
    """A BertForSequenceClassification directory of 3 labels: no model.task, no model.num_labels;
    the export is the same 3-way classifier."""
    from transformers import AutoModelForSequenceClassification

    source = _bert_dir(tmp_path / "bert", "BertForSequenceClassification")
    run = tmp_path / "run"
    args = ["model=hf", f"model.path={source}", "data=synthetic", "data.seq_len=16", "trainer.max_steps=3"]
    args += ["trainer.global_batch_size=4", "trainer.micro_batch_size=2", "checkpoint.export_safetensors=true"]
    args += ["trainer.progress_bar=false", "logging.tensorboard=false", f"hydra.run.dir={run}"]
    out = run_main(args, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded, info = AutoModelForSequenceClassification.from_pretrained(
        run / "checkpoints" / "export", output_loading_info=True
    )
    assert not any(info.values()), info
    assert loaded.config.num_labels == 3 and loaded.classifier.out_features == 3


def test_a_head_we_do_not_train_names_the_override(tmp_path):
    source = _bert_dir(tmp_path / "bert", "BertForMaskedLM")
    out = run_main(
        ["model=hf", f"model.path={source}", "data=synthetic", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path
    )
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "['BertForMaskedLM']" in lines[0] and "set model.task" in lines[0], out.stderr
    assert "Traceback" not in out.stderr
