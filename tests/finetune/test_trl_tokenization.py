"""Fine-tuning's and DPO's records become the ids TRL 1.16's SFTTrainer and DPOTrainer make of the
same data (their own dataset preparation, run here offline on a tiny model): with a tokenizer that
adds a BOS (as Llama, Mistral and Gemma's do) and with prompts that end inside a pre-token (a
trailing space), where encoding prompt and reply apart would give other ids."""

from __future__ import annotations

import copy

import pytest
import torch
from bos_tokenizer import bos_tokenizer

from framework.data.tokenizer import load_tokenizer
from framework.dpo.data import encode_pair, pair_rows
from framework.finetune.data import IGNORE_INDEX, encode_record, pad_rows

# Prompts ending in a space (its token merges with the reply's first word when encoded together),
# at a word boundary, and inside a word; replies that do and do not start with a space.
SFT = [
    {"prompt": "what is 1 plus 2? it is ", "response": "3"},
    {"prompt": "x = ", "response": "4; y = x + 1"},
    {"prompt": "what is 7 plus", "response": " 1? it is 8"},
    {"prompt": "y = x + 1", "response": "2"},
]
DPO = [
    {"prompt": "what is 2 plus 2? it is ", "chosen": "4", "rejected": "5"},
    {"prompt": "x = ", "chosen": "9", "rejected": " 9"},  # the two part from the prompt at different places
    {"prompt": "what is 3 plus 3?", "chosen": " it is 6", "rejected": " it is 7"},
]


def _tiny_llama(vocab: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The BOS-adding tokenizer, and the same without its post-processor (a GPT-2 style BPE)."""
    return {bos: bos_tokenizer(str(tmp_path_factory.mktemp(f"bos{bos}")), bos=bos) for bos in (True, False)}


# (adds a BOS, read from its directory through transformers or from its tokenizer.json)
FORMS = [(True, "directory"), (True, "tokenizer.json"), (False, "directory")]


@pytest.mark.parametrize("bos,form", FORMS)
def test_sft_records_are_trls_prompt_completion_ids_and_completion_mask(tmp_path, tokenizers, bos, form):
    tokenizer_dir = tokenizers[bos]
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    fast = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert (fast("x")["input_ids"][0] == fast.bos_token_id) == bos  # the tokenizer adds its BOS, or not
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, save_strategy="no")
    data = Dataset.from_list([{"prompt": r["prompt"], "completion": r["response"]} for r in SFT])
    theirs = SFTTrainer(
        model=_tiny_llama(len(fast)), args=args, train_dataset=data, processing_class=fast
    ).train_dataset
    tok = load_tokenizer(tokenizer_dir if form == "directory" else f"{tokenizer_dir}/tokenizer.json")
    for record, trl_row in zip(SFT, theirs):
        doc = encode_record(record, tok)
        assert doc.ids == trl_row["input_ids"], (record, fast.convert_ids_to_tokens(doc.ids))
        assert doc.train == [label != IGNORE_INDEX for label in trl_row["labels"]], record
        # the row trained on: each position's label is the next token where TRL learns it
        [row] = pad_rows([doc], 32, tok.eod)
        n = len(doc.ids) - 1
        assert row["input_ids"][:n].tolist() == trl_row["input_ids"][:-1]
        assert row["labels"][:n].tolist() == trl_row["labels"][1:]
    assert (encode_record(SFT[0], tok).ids[0] == fast.bos_token_id) == bos


@pytest.mark.parametrize("bos,form", FORMS)
def test_dpo_pairs_are_trls_prompt_chosen_and_rejected_ids(tmp_path, tokenizers, bos, form):
    tokenizer_dir = tokenizers[bos]
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    fast = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    args = DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False, save_strategy="no")
    model = _tiny_llama(len(fast))
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),  # else TRL loads the reference by the model's name (a hub download)
        args=args,
        train_dataset=Dataset.from_list(DPO),
        processing_class=fast,
    )
    theirs = trainer.train_dataset
    tok = load_tokenizer(tokenizer_dir if form == "directory" else f"{tokenizer_dir}/tokenizer.json")
    for record, trl_row in zip(DPO, theirs):
        chosen, rejected = encode_pair(record, tok, "prompt", "chosen", "rejected", "test")
        prompt = trl_row["prompt_ids"]
        for doc, reply in ((chosen, trl_row["chosen_ids"]), (rejected, trl_row["rejected_ids"])):
            assert doc.ids == prompt + reply, (record, fast.convert_ids_to_tokens(doc.ids))
            assert doc.train == [False] * len(prompt) + [True] * len(reply), record
    # TRL's collated batch against our rows: the same ids, and labels exactly where its completion mask is
    batch = trainer.data_collator([theirs[i] for i in range(len(DPO))])
    rows = pair_rows([encode_pair(r, tok, "prompt", "chosen", "rejected", "test") for r in DPO], 32, tok.eod)
    for i, row in enumerate(rows):
        for side, offset in ((0, 0), (1, len(DPO))):
            ids, mask = batch["input_ids"][i + offset], batch["completion_mask"][i + offset]
            kept = batch["attention_mask"][i + offset].bool()
            ids, mask = ids[kept].tolist(), mask[kept].tolist()
            n = len(ids) - 1
            assert row["input_ids"][side][:n].tolist() == ids[:-1]
            want = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
            assert row["labels"][side][:n].tolist() == want


def test_grpo_text_prompts_are_the_tokenizers_own_ids(tokenizers):
    # TRL's GRPOTrainer tokenizes a text prompt as `tokenizer(text=prompt)`: its BOS first
    import transformers

    from framework.grpo.data import encode_prompt

    fast = transformers.AutoTokenizer.from_pretrained(tokenizers[True])
    tok = load_tokenizer(tokenizers[True])
    for prompt in ("what is 1 plus 2? it is ", "x = 4"):
        got = encode_prompt({"prompt": prompt, "answer": 3}, tok, "prompt", "answer", True, "test")
        assert got.ids == fast(text=prompt)["input_ids"] and got.ids[0] == fast.bos_token_id
        assert got.text == prompt


def test_built_in_chat_lines_start_with_the_bos_once(tokenizers):
    import transformers

    from framework.dpo.data import encode_pair

    fast = transformers.AutoTokenizer.from_pretrained(tokenizers[True])
    tok = load_tokenizer(tokenizers[True])
    assert not tok.has_chat_template
    turns = [{"role": "user", "content": "x = 4"}, {"role": "assistant", "content": "y = 5"}]
    doc = encode_record({"messages": turns}, tok)
    assert doc.ids[0] == fast.bos_token_id and doc.ids.count(fast.bos_token_id) == 1 and not doc.train[0]
    assert fast.decode(doc.ids) == "<s><|user|>\nx = 4</s><|assistant|>\ny = 5</s>"
    chosen, _ = encode_pair(
        {"prompt": turns[:1], "chosen": turns[1:], "rejected": "y = 6"}, tok, "prompt", "chosen", "rejected", "t"
    )
    assert chosen == doc


def test_seq2seq_rows_are_the_tokenizers_own_ids(tmp_path):
    # a T5-like tokenizer puts its </s> after every text: the encoder's input is tokenizer(prompt),
    # the labels tokenizer(response), whose </s> is the end-of-document token (not doubled)
    import transformers

    from framework.finetune.data import seq2seq_rows

    directory = bos_tokenizer(str(tmp_path / "t5"), template="$A </s>")
    fast = transformers.AutoTokenizer.from_pretrained(directory)
    tok = load_tokenizer(directory)
    [row] = seq2seq_rows([{"prompt": "what is 1 plus 2?", "response": "it is 3"}], tok, 16, 8)
    source = fast("what is 1 plus 2?")["input_ids"]
    target = fast(text_target="it is 3")["input_ids"]
    assert source[-1] == target[-1] == tok.eod == fast.eos_token_id
    assert row["input_ids"][: len(source)].tolist() == source and row["attention_mask"].sum() == len(source)
    assert row["labels"][: len(target)].tolist() == target and (row["labels"][len(target) :] == IGNORE_INDEX).all()
