"""stage=dpo's pieces in one process: the preference losses against TRL's DPOTrainer and against
values computed by hand, and how preference records become rows (the jobs: tests/finetune/test_dpo.py)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from framework.config.dpo import DPOConfig
from framework.data.tokenizer import SFTTokenizer
from framework.dpo.data import encode_pair, pair_rows
from framework.dpo.loss import PairLogps, pair_logps, preference_loss
from framework.errors import UserInputError
from framework.finetune.data import IGNORE_INDEX

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT = [
    {
        "prompt": [{"role": "user", "content": f"what is {i} plus {j}?"}],
        "chosen": [{"role": "assistant", "content": f"it is {i + j}"}],
        "rejected": [{"role": "assistant", "content": f"it is {i + j + 1}{'0' * i}"}],
    }
    for i, j in [(1, 2), (3, 4), (5, 0), (2, 7)]
]


def _hf_tokenizer():
    """A byte-level BPE with a chat template, built here (nothing downloaded)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f"what is {i} plus {j}? it is {i + j}" for i in range(10) for j in range(10)]
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=200,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|end|>")
    fast.chat_template = TEMPLATE
    return fast


def _batch(records, tok, seq_len=64):
    rows = pair_rows([encode_pair(r, tok, "prompt", "chosen", "rejected", "test") for r in records], seq_len, tok.eod)
    assert len(rows) == len(records)
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def test_chat_pairs_learn_the_reply_tokens_only_and_an_implicit_prompt_is_the_shared_turns():
    fast = _hf_tokenizer()
    tok = SFTTokenizer(None, fast.eos_token_id, hf=fast)
    record = CHAT[1]
    chosen, rejected = encode_pair(record, tok, "prompt", "chosen", "rejected", "test")
    assert fast.decode(chosen.ids) == "<|user|>what is 3 plus 4?<|end|><|assistant|>it is 7<|end|>"
    learned = [i for i, t in zip(chosen.ids, chosen.train) if t]
    assert fast.decode(learned) == "it is 7<|end|>"  # the reply and the template's end of turn
    assert fast.decode([i for i, t in zip(rejected.ids, rejected.train) if t]) == "it is 8000<|end|>"
    # The same pair as two whole conversations (no prompt column): the same documents.
    implicit = {"chosen": record["prompt"] + record["chosen"], "rejected": record["prompt"] + record["rejected"]}
    assert encode_pair(implicit, tok, "prompt", "chosen", "rejected", "test") == (chosen, rejected)
    # A row's labels: -100 but where the next token is the reply's.
    [row] = pair_rows([(chosen, rejected)], 32, tok.eod)
    labels = row["labels"][0]
    assert fast.decode(labels[labels != IGNORE_INDEX].tolist()) == "it is 7<|end|>"
    with pytest.raises(UserInputError, match=r"^pairs.jsonl: record 3: a preference record needs"):
        encode_pair({"prompt": "x", "chosen": "y"}, tok, "prompt", "chosen", "rejected", "pairs.jsonl: record 3")


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_the_loss_equals_trls_dpo_trainer_on_the_same_model_and_batch(tmp_path, loss):
    import transformers
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer

    fast = _hf_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # a policy some way from its reference, so the loss is not ln 2
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    ours_cfg = DPOConfig(loss=loss, beta=0.3)
    batch = _batch(CHAT, SFTTokenizer(None, fast.eos_token_id, hf=fast))
    with torch.no_grad():
        losses, _ = preference_loss(
            ours_cfg,
            pair_logps(policy, batch["input_ids"], batch["labels"]),
            pair_logps(reference, batch["input_ids"], batch["labels"]),
        )
    # TRL's batch: the whole set of pairs (the mean does not depend on their order). bf16=False:
    # TRL's default autocasts its reference model to bf16 on a CPU that has it.
    args = TRLConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(CHAT),
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.3,
        loss_type=[loss],
        max_length=None,
        save_strategy="no",
    )
    trl = DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(CHAT), processing_class=fast
    )
    with torch.no_grad():
        theirs = trl.compute_loss(trl.model, next(iter(trl.get_train_dataloader())))
    assert abs(losses.mean().item() - math.log(2)) > 0.05  # a loss away from the start's
    # 1e-5: both sum fp32 log-probabilities of the same tokens, TRL's in tiles (measured: 1e-6 and 2e-6).
    assert losses.mean().item() == pytest.approx(theirs.item(), abs=1e-5)


def test_ipo_simpo_and_label_smoothing_equal_values_computed_by_hand():
    # Two pairs: summed log-probabilities of the policy and the reference, and the replies' lengths.
    policy = PairLogps(
        torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -8.0]), torch.tensor([2, 3]), torch.tensor([4, 2])
    )
    reference = PairLogps(
        torch.tensor([-5.0, -9.5]), torch.tensor([-5.0, -7.0]), torch.tensor([2, 3]), torch.tensor([4, 2])
    )
    # IPO, beta 0.5: pair 1 ((-4+5)/2 - (-6+5)/4 - 1)^2 = (0.5 + 0.25 - 1)^2 = 0.0625;
    # pair 2 ((-9+9.5)/3 - (-8+7)/2 - 1)^2 = (1/6 + 1/2 - 1)^2 = 1/9.
    losses, stats = preference_loss(DPOConfig(loss="ipo", beta=0.5), policy, reference)
    torch.testing.assert_close(losses, torch.tensor([0.0625, 1 / 9]))
    torch.testing.assert_close(stats["rewards/chosen"], torch.tensor([0.5, 0.25]))
    torch.testing.assert_close(stats["rewards/accuracies"], torch.tensor([1.0, 1.0]))
    # SimPO, beta 2, gamma 0.5, no reference: z = 2 (-4/2 + 6/4) - 0.5 = -1.5 and 2 (-3 + 4) - 0.5 = 1.5.
    losses, stats = preference_loss(DPOConfig(loss="simpo", beta=2.0, simpo_gamma=0.5), policy, None)
    hand = [math.log(1 + math.exp(1.5)), math.log(1 + math.exp(-1.5))]  # -log sigmoid(z)
    torch.testing.assert_close(losses, torch.tensor(hand))
    torch.testing.assert_close(stats["rewards/margins"], torch.tensor([-1.0, 2.0]))
    assert "logratios/chosen" not in stats
    # DPO with label smoothing 0.1, beta 0.5: z = 0.5 ((1) - (-1)) = 1 and 0.5 (0.5 + 1) = 0.75.
    losses, _ = preference_loss(DPOConfig(beta=0.5, label_smoothing=0.1), policy, reference)
    hand = [0.9 * math.log(1 + math.exp(-z)) + 0.1 * math.log(1 + math.exp(z)) for z in (1.0, 0.75)]
    torch.testing.assert_close(losses, torch.tensor(hand))


def test_adapters_disabled_gives_the_base_model_and_only_within_the_block():
    from framework.config.schema import ModelConfig
    from framework.models.llama.model import build_llama
    from framework.peft import apply_lora
    from framework.peft.lora import adapters_disabled

    args = dict(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, max_seq_len=32)
    model = build_llama(ModelConfig(args=args))
    model.init_weights(seed=0)
    ids = torch.arange(16)[None] % 64
    with torch.no_grad():
        base = model(ids)
        apply_lora(model, rank=4, alpha=8.0, targets=["wq", "wv"], seed=0)
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.normal_(0, 0.1)  # a trained adapter: B no longer zero
        adapted = model(ids)
        with adapters_disabled(model):
            off = model(ids)
        again = model(ids)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(off, base) and torch.equal(again, adapted)


def test_parquet_with_renamed_columns_reads_as_jsonl_with_the_default_names(tmp_path):
    from datasets import Dataset

    from framework.config.schema import Config
    from framework.dpo.data import read_pairs

    fast = _hf_tokenizer()
    tok = SFTTokenizer(None, fast.eos_token_id, hf=fast)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in CHAT)
    renamed = [{"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in CHAT]
    Dataset.from_list(renamed).to_parquet(str(tmp_path / "pairs.parquet"))
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.paths = [str(tmp_path / "pairs.jsonl")]
    from_jsonl = read_pairs(cfg, tok)
    cfg.data.paths = [str(tmp_path / "pairs.parquet")]
    cfg.data.hf.prompt_field, cfg.dpo.chosen_field, cfg.dpo.rejected_field = "question", "good", "bad"
    assert read_pairs(cfg, tok) == from_jsonl and len(from_jsonl) == len(CHAT)
    cfg.dpo.rejected_field = "worse"  # a column the file does not have: named, with the settings to fix it
    with pytest.raises(UserInputError, match=r"has columns \['question', 'good', 'bad'\], not 'worse'; name its"):
        read_pairs(cfg, tok)


def test_a_reply_longer_than_seq_len_is_cut_and_only_a_pair_without_reply_tokens_left_out():
    """docs/fine_tuning.md: a sequence is cut at data.seq_len keeping its start (TRL's keep_start);
    a pair is left out only when one of its replies has no token within data.seq_len."""
    from framework.finetune.data import Document

    def doc(prompt: int, reply: int) -> Document:  # ids 1.. ; the reply's tokens train
        return Document(list(range(1, prompt + reply + 1)), [False] * prompt + [True] * reply)

    # prompt 3 + reply 10 in 8 positions: the reply's first 5 tokens are labels (targets 4..8)
    [row] = pair_rows([(doc(3, 10), doc(3, 2))], 8, pad_id=0)
    assert row["labels"][0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 4, 5, 6, 7, 8, 9]
    assert row["input_ids"][0].tolist() == list(range(1, 9))
    assert row["labels"][1].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 4, 5] + [IGNORE_INDEX] * 4
    # a prompt of 9 tokens: no reply token within 8 positions, so the pair is left out
    assert pair_rows([(doc(9, 2), doc(3, 2))], 8, pad_id=0) == []
