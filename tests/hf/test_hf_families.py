"""Hugging Face models as users bring them: a `save_pretrained` directory of each of 15 families
(names and shapes as transformers writes them, MoE experts one tensor each) trains through our
engine on 2 ranks exactly like the same directory in a plain single-process loop
(`from_pretrained` + `torch.optim.AdamW`, the same global batches, lr and clipping): 5 losses and
the final weights within 1e-5.

Tolerance 1e-5 (fp32): the sharded run reduces gradients over 2 ranks and 2 micro-steps in another
order, ~1e-7 per step. Adam divides by the root of each gradient's second moment, so a gradient
component near zero turns that reordering noise into an update of up to ~lr: with lr=1e-3 and
eps=1e-6 (which damps components below ~1e-6) the worst weight differs by 1.2e-6 over the 15
families, the worst loss by 1.9e-6. A wrong optimizer start (AdamW's step counter at 1 after
importing, which turns off bias correction) moves the losses by > 1e-3, a mis-merged expert by far
more.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.hf.test_hf_parity import make_config

ZERO_DROPOUT = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "opt": {"dropout": 0.0, "attention_dropout": 0.0},
    "bart": {"dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0},
    "mt5": {"dropout_rate": 0.0},
    "phi3": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "gpt_neox": {"hidden_dropout": 0.0, "attention_dropout": 0.0},
}
DECODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
FAMILIES = {  # label: (model_type, config, task)
    "gpt2": ("gpt2", dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64), "causal_lm"),
    "llama": ("llama", DECODER, "causal_lm"),
    "mistral": ("mistral", DECODER, "causal_lm"),
    "gemma": ("gemma", dict(DECODER, head_dim=8), "causal_lm"),
    "gemma2": ("gemma2", dict(DECODER, head_dim=8, sliding_window=16), "causal_lm"),
    "phi3": ("phi3", dict(DECODER, pad_token_id=0), "causal_lm"),
    "gpt_neox": ("gpt_neox", {k: v for k, v in DECODER.items() if k != "num_key_value_heads"}, "causal_lm"),
    "opt": (
        "opt",
        dict(
            num_hidden_layers=2,
            hidden_size=32,
            ffn_dim=64,
            num_attention_heads=4,
            vocab_size=128,
            word_embed_proj_dim=32,
        ),
        "causal_lm",
    ),
    "qwen2": ("qwen2", DECODER, "causal_lm"),
    "qwen3": ("qwen3", dict(DECODER, head_dim=8), "causal_lm"),
    "mixtral": ("mixtral", dict(DECODER, num_local_experts=4, num_experts_per_tok=2), "causal_lm"),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            DECODER, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2
        ),
        "causal_lm",
    ),
    "bert_classify": (
        "bert",
        dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=128),
        "sequence_classification",
    ),
    "bart": (
        "bart",
        dict(
            encoder_layers=2,
            decoder_layers=2,
            d_model=32,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            vocab_size=128,
            max_position_embeddings=64,
        ),
        "seq2seq",
    ),
    "mt5": (
        "mt5",
        dict(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, num_heads=4, d_ff=64, vocab_size=128),
        "seq2seq",
    ),
}
AUTO = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "sequence_classification": "AutoModelForSequenceClassification",
}
TOL = 1e-5  # see the module docstring
STEPS = 5


def _adamw_config(directory: str, task: str, run_dir: str):
    from framework.config.schema import OptimizerConfig

    cfg = make_config({}, task, {}, run_dir, steps=STEPS, path=directory)
    cfg.optimizer = OptimizerConfig(
        name="adamw", lr=1e-3, eps=1e-6, weight_decay=0.0, warmup_steps=0, schedule="constant", clip_grad_norm=1.0
    )
    return cfg


def _plain_loop(cfg, task_name: str):
    """The directory in a plain transformers loop on one process: from_pretrained, torch's AdamW."""
    import transformers

    from framework.data import build_data
    from framework.models import family_of

    family = family_of(cfg.model)
    task = family.task(cfg.model)
    model = getattr(transformers, AUTO[task_name]).from_pretrained(cfg.model.path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    data = build_data(
        cfg.data,
        vocab_size=family.vocab_size(cfg.model),
        micro_batch_size=4,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        seed=cfg.trainer.seed,
        sample_kind=task.sample_kind,
        num_labels=family.num_labels(cfg.model),
    )
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    losses = []
    for _ in range(STEPS):
        loss = task.loss(model, data.train.next_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _families_rank(rank, world, run_dir, dirs):
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    out = {}
    for label, (_, _, task) in FAMILIES.items():
        cfg = _adamw_config(dirs[label], task, run_dir)
        ref_losses, ref_weights = _plain_loop(cfg, task)
        trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
        assert trainer.ckpt.resume(trainer.state) == 0
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        worst, compared, where = 0.0, 0, ""
        for name, value in trainer.model.state_dict().items():
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value
            if name in ref_weights:
                diff = (whole - ref_weights[name]).abs().max().item()
                worst, where = max((worst, where), (diff, name))
                compared += 1
        out[label] = {"losses": losses, "ref": ref_losses, "weights": worst, "where": where, "compared": compared}
        trainer.ckpt.close()
        del trainer
    return out


def test_save_pretrained_directories_of_15_families_train_like_a_plain_adamw_loop(tmp_path):
    import transformers

    from tests.distributed.harness import run_ranks

    dirs = {}
    for label, (model_type, config, task) in FAMILIES.items():
        settings = dict(config, **ZERO_DROPOUT.get(model_type, {}))
        hf_config = transformers.AutoConfig.for_model(model_type, **settings)
        torch.manual_seed(3)
        model = getattr(transformers, AUTO[task]).from_config(hf_config)
        dirs[label] = str(tmp_path / label)
        model.save_pretrained(dirs[label])  # the names and shapes a user's directory has
    results = run_ranks(_families_rank, world_size=2, args=(str(tmp_path), dirs), timeout_s=600)
    for label, r in results[0].items():  # the table, for the log of a failing run
        worst = max(abs(a - b) for a, b in zip(r["losses"], r["ref"]))
        print(f"{label:14s} loss diff {worst:.2e}  weight diff {r['weights']:.2e} ({r['where']})")
    for label in FAMILIES:
        for rank in range(2):
            r = results[rank][label]
            assert all(math.isfinite(x) for x in r["losses"]), (label, r)
            diffs = [abs(a - b) for a, b in zip(r["losses"], r["ref"])]
            assert len(diffs) == STEPS and max(diffs) <= TOL, (label, rank, r)
            assert r["compared"] > 0 and r["weights"] <= TOL, (label, rank, r)
        losses = results[0][label]["losses"]
        assert max(losses) - min(losses) > 1e-3, (label, losses)  # it trains (the comparison is not vacuous)


@pytest.mark.parametrize("label", ["gpt_neox", "mixtral"])
def test_export_of_a_renamed_or_fused_family_loads_in_transformers(label, tmp_path):
    """The export keeps the model's own names; transformers loads it to the same weights."""
    import transformers
    from conftest import TINY, run_main

    model_type, config, task = FAMILIES[label]
    hf_config = transformers.AutoConfig.for_model(model_type, **dict(config, **ZERO_DROPOUT.get(model_type, {})))
    torch.manual_seed(3)
    source = tmp_path / "src"
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(source)
    args = [a for a in TINY if not a.startswith("model=")] + ["model=hf", f"model.path={source}", "data.seq_len=16"]
    out = run_main(
        args
        + ["trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=1"]
        + ["checkpoint.export_safetensors=true", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # Every tensor comes from the export: none missing (from_pretrained would fill it at random),
    # none left over, none of another shape.
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoints" / "export", output_loading_info=True
    )
    assert not any(info.values()), info
    original = transformers.AutoModelForCausalLM.from_pretrained(source).state_dict()
    trained = exported.state_dict()
    assert trained.keys() == original.keys()
    # Two AdamW steps in warm-up (lr 3e-4 then 6e-4) move a weight by about 1e-3 at most; a tensor
    # filled at random or under another name differs from the source by ~0.1 (std 0.02 weights).
    moved = {name: (trained[name] - original[name]).abs().max().item() for name in original}
    assert max(moved.values()) > 0, moved  # it trained, from the imported weights
    assert all(diff < 1e-2 for diff in moved.values()), moved


def _lora_rank(rank, world, run_dir, directory):
    """Our LoRA on 2 ranks and peft's on one process, from the same directory and the same initial
    adapters (ours copied into peft's): 5 losses each."""
    import peft
    import transformers

    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    cfg = _adamw_config(directory, "causal_lm", run_dir)
    cfg.peft.lora.enabled, cfg.peft.lora.rank, cfg.peft.lora.alpha = True, 4, 8.0
    cfg.peft.lora.targets = ["q_proj", "v_proj"]
    trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
    assert trainer.ckpt.resume(trainer.state) == 0
    adapters = {}
    for name, value in trainer.model.state_dict().items():
        if ".lora_" in name:
            adapters[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    trainer.ckpt.close()
    del trainer

    from framework.data import build_data
    from framework.models import family_of

    base = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    base.config.use_cache = False
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    peft_params = dict(model.named_parameters())
    copied = 0
    for name, value in adapters.items():  # ours: <layer>.lora_a / .lora_b; peft's: <layer>.lora_A.default.weight
        layer, kind = name.rsplit(".", 1)
        target = f"base_model.model.{layer}.lora_{kind[-1].upper()}.default.weight"
        with torch.no_grad():
            peft_params[target].copy_(value)
        copied += 1
    family = family_of(cfg.model)
    task = family.task(cfg.model)
    data = build_data(
        cfg.data,
        vocab_size=family.vocab_size(cfg.model),
        micro_batch_size=4,
        global_batch_size=4,
        dp_rank=0,
        dp_size=1,
        seed=cfg.trainer.seed,
        sample_kind=task.sample_kind,
        num_labels=0,
    )
    o = cfg.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=0.0)
    ref = []
    for _ in range(STEPS):
        loss = task.loss(model, data.train.next_batch())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, o.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ref.append(loss.item())
    return {"losses": losses, "ref": ref, "copied": copied, "trainable": len(trainable)}


def test_our_lora_follows_peft_on_the_same_model(tmp_path):
    import transformers

    from tests.distributed.harness import run_ranks

    model_type, config, _ = FAMILIES["llama"]
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config)
    ).save_pretrained(tmp_path / "llama")
    results = run_ranks(_lora_rank, world_size=2, args=(str(tmp_path), str(tmp_path / "llama")), timeout_s=300)
    for r in results:
        assert r["copied"] == r["trainable"] == 8, r  # 2 layers x (q, v) x (A, B)
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref"])) <= TOL, r
        assert max(r["losses"]) - min(r["losses"]) > 1e-4, r  # the adapters train


def _directory_with_tokenizer(out, model_vocab: int) -> int:
    """A save_pretrained directory holding a GPT-2 of `model_vocab` ids and its own byte-level BPE
    tokenizer (tokenizer.json + tokenizer_config.json); returns the tokenizer's size."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["def add(a, b): return a + b", "the quick brown fox jumps over the lazy dog"] * 50
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|eos|>"], initial_alphabet=alphabet)
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=model_vocab, n_positions=128, eos_token_id=0, bos_token_id=0
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    fast.save_pretrained(out)
    return len(fast)


@pytest.mark.parametrize("fits", [True, False])
def test_fine_tuning_uses_the_directorys_own_tokenizer_and_checks_its_ids(tmp_path, fits):
    import json

    from conftest import TINY, run_main

    size = _directory_with_tokenizer(tmp_path / "model", 400)
    if not fits:  # the same tokenizer beside a model with fewer ids than it gives
        _directory_with_tokenizer(tmp_path / "model", size - 40)
    records = tmp_path / "sft.jsonl"
    records.write_text(
        "".join(json.dumps({"prompt": f"def add{i}(a, b):", "response": " return a + b"}) + "\n" for i in range(40))
    )
    args = [a for a in TINY if not a.startswith(("model=", "data="))]
    out = run_main(
        args
        + ["stage=fine_tuning", "model=hf", f"model.path={tmp_path / 'model'}", f"finetune.train_file={records}"]
        + ["finetune.packing=false", "data.seq_len=32", "trainer.max_steps=2", "trainer.global_batch_size=4"]
        + ["trainer.micro_batch_size=1", "trainer.sample_tokens=8", f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    if fits:
        assert "--- sample ---" in out.stdout + out.stderr, out.stderr[-3000:]  # the end-of-run text sample
        assert out.returncode == 0, out.stderr[-3000:]
        used = next(line for line in out.stderr.splitlines() if line.startswith("fine-tuning with the tokenizer"))
        assert f"tokenizer {tmp_path / 'model'}/" in used and f"({size} ids)" in used, used
    else:
        assert out.returncode == 2, out.stderr[-3000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"but model.path={tmp_path / 'model'} has only {size - 40} ids" in errors[0], errors
        assert "Traceback" not in out.stderr


def _lie_in_safetensors_header(directory) -> None:
    """Make the first tensor's byte range in model.safetensors' header run 1 MB past the data."""
    import json
    import struct

    path = directory / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 1 << 20
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize(
    "bad", ["pickled_weights_only", "config_not_json", "lying_safetensors_header", "non_utf8_records"]
)
def test_bad_files_in_a_model_directory_are_one_line_refusals(tmp_path, bad, stdlib_cache):
    import transformers
    from conftest import TINY, run_main

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=2100, n_positions=128)
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    named = str(model_dir)
    extra = []
    if bad == "pickled_weights_only":
        (model_dir / "model.safetensors").unlink()
        (model_dir / "pytorch_model.bin").write_bytes(b"not loaded")
        named = "pytorch_model.bin"
    elif bad == "config_not_json":
        (model_dir / "config.json").write_text('{"model_type": "gpt2", ')
        named = str(model_dir / "config.json")
    elif bad == "lying_safetensors_header":
        _lie_in_safetensors_header(model_dir)
        named = str(model_dir / "model.safetensors")
    else:
        records = tmp_path / "sft.jsonl"
        records.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "caf\xe9", "response": "b"}\n')
        extra = ["stage=fine_tuning", f"finetune.train_file={records}", "finetune.packing=false"]
        named = f"{records}:2"
    args = [a for a in TINY if not a.startswith(("model=", "data="))]
    out = run_main(
        args
        + ["model=hf", f"model.path={model_dir}", "data=stdlib", stdlib_cache, "data.seq_len=32"]
        + ["trainer.max_steps=2", "cluster.nproc_per_node=1"]  # one rank: every rank reads these files alike
        + ["trainer.global_batch_size=4", "trainer.micro_batch_size=1", f"hydra.run.dir={tmp_path}/run", *extra],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
