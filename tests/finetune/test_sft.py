"""Fine-tuning data and LoRA, single process: the loss sees response tokens only, packed documents
compute what they compute alone, adapters start as a no-op, train alone and merge exactly."""

from __future__ import annotations

import json

import pytest
import torch

from framework.config.schema import ModelConfig
from framework.errors import UserInputError
from framework.finetune.data import (
    IGNORE_INDEX,
    SFTTokenizer,
    build_rows,
    encode_record,
    pack,
    pad_rows,
    read_records,
)
from framework.models.llama.model import build_llama
from framework.peft import adapter_state, apply_lora, merge_lora_, merged_state

RECORDS = [
    {"prompt": "def add(a, b):\n", "response": "    return a + b\n"},
    {
        "messages": [
            {"role": "system", "content": "Complete the function."},
            {"role": "user", "content": "def neg(x):"},
            {"role": "assistant", "content": "    return -x"},
            {"role": "user", "content": "def inc(x):"},
            {"role": "assistant", "content": "    return x + 1"},
        ]
    },
    {"prompt": "x = ", "response": "1"},
]


class ByteTokenizer:
    """Bytes as ids 1..256; id 0 ends a document (as in our stdlib tokenizer)."""

    vocab_size = 257

    def encode(self, text):
        return [b + 1 for b in text.encode()]

    def decode(self, ids):
        return bytes(i - 1 for i in ids if i).decode(errors="replace")


TOK = SFTTokenizer(ByteTokenizer(), eod=0)


def _model(vocab=257, seed=0):
    model = build_llama(
        ModelConfig(
            args=dict(vocab_size=vocab, dim=32, n_heads=4, n_kv_heads=2, ffn_dim=64, n_layers=2, max_seq_len=256)
        )
    )
    model.init_weights(seed=seed)
    return model


def test_labels_cover_response_tokens_only():
    doc = encode_record(RECORDS[0], TOK)
    prompt = TOK.encode(RECORDS[0]["prompt"])
    assert doc.ids == prompt + TOK.encode(RECORDS[0]["response"]) + [0]
    [row] = pad_rows([doc], seq_len=64, pad_id=0)
    labels = row["labels"].tolist()
    # Position i predicts token i + 1: the prompt's next tokens (but the last, which predicts the
    # response's first) are masked; every response token and the end-of-document are targets.
    assert labels[: len(prompt) - 1] == [IGNORE_INDEX] * (len(prompt) - 1)
    assert labels[len(prompt) - 1 : len(doc.ids) - 1] == doc.ids[len(prompt) :]
    assert set(labels[len(doc.ids) - 1 :]) == {IGNORE_INDEX}
    # Chat: system and user turns are masked, both assistant turns learned.
    chat = encode_record(RECORDS[1], TOK)
    learned = TOK.decode([i for i, t in zip(chat.ids, chat.train) if t])
    assert learned == "    return -x    return x + 1"


def test_changing_a_prompt_tokens_label_does_not_change_the_loss():
    model = _model()
    [row] = pad_rows([encode_record(RECORDS[0], TOK)], seq_len=48, pad_id=0)
    learned = row["labels"] != IGNORE_INDEX  # the pipeline's mask: response tokens only
    prompt = torch.nonzero(~learned[: len(TOK.encode(RECORDS[0]["prompt"])) - 1]).flatten()
    assert len(prompt) > 5
    logits = model(row["input_ids"][None])
    logits.retain_grad()
    loss = torch.nn.functional.cross_entropy(logits[0], row["labels"], ignore_index=IGNORE_INDEX)
    loss.backward()
    # The predictions made at prompt positions get no gradient at all; response ones do.
    assert torch.equal(logits.grad[0, prompt], torch.zeros_like(logits.grad[0, prompt]))
    assert logits.grad[0, learned].abs().sum(-1).min() > 0
    # Prompt tokens' labels replaced by other token ids, then masked as the pipeline masks: the
    # same loss, bit for bit. Left unmasked (a pipeline without the mask) they change it.
    changed = row["labels"].clone()
    changed[prompt] = (torch.arange(len(prompt)) * 13 + 7) % 257
    with torch.no_grad():
        out = model(row["input_ids"][None])[0]
        same = torch.nn.functional.cross_entropy(
            out, torch.where(learned, changed, IGNORE_INDEX), ignore_index=IGNORE_INDEX
        )
        unmasked = torch.nn.functional.cross_entropy(out, changed, ignore_index=IGNORE_INDEX)
    assert torch.equal(same, loss.detach())
    assert not torch.allclose(unmasked, loss.detach())


def test_packed_documents_do_not_attend_across_boundaries():
    model = _model()
    docs = [encode_record(r, TOK) for r in RECORDS]
    rows = pack(docs, seq_len=256, pad_id=0)
    assert len(rows) == 1  # all three fit in one row (their lengths sum to < 256)
    row = rows[0]
    packed = model(row["input_ids"][None], positions=row["positions"][None], document_ids=row["document_ids"][None])[0]
    start = 0
    for doc in docs:
        alone = model(torch.tensor(doc.ids[:-1])[None])[0]
        # fp32: the masked attention path and the causal one sum in another order; 1e-5 is ~100x
        # the differences measured (1e-7) and far below any leak across documents (~1e-1).
        torch.testing.assert_close(packed[start : start + len(alone)], alone, rtol=0, atol=1e-5)
        start += len(alone)
    # Without the document mask the second document would see the first: the test can fail.
    leaky = model(row["input_ids"][None])[0]
    second = slice(len(docs[0].ids) - 1, len(docs[0].ids) - 1 + len(docs[1].ids) - 1)
    assert (leaky[second] - packed[second]).abs().max() > 1e-3
    # The packed loss equals the token-weighted mean of the documents' losses alone.
    per_doc = [pad_rows([d], seq_len=len(d.ids) - 1, pad_id=0)[0] for d in docs]
    total = sum(
        torch.nn.functional.cross_entropy(
            model(r["input_ids"][None])[0], r["labels"], reduction="sum", ignore_index=IGNORE_INDEX
        )
        for r in per_doc
    )
    count = sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in per_doc)
    packed_loss = torch.nn.functional.cross_entropy(packed, row["labels"], ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(packed_loss, total / count, rtol=1e-5, atol=0)


def test_rows_padding_and_bad_records(tmp_path):
    rows = build_rows(RECORDS, TOK, seq_len=24, packing=False)
    # The chat record's first response token lies past 24 tokens: nothing to learn, dropped.
    assert len(rows) == 2 and all(r["input_ids"].shape == (24,) for r in rows)
    assert len(build_rows(RECORDS, TOK, seq_len=96, packing=False)) == 3
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"prompt": "no response"}) + "\n")
    with pytest.raises(UserInputError, match=r"bad.jsonl:2: a record needs"):
        read_records(str(path))


def test_lora_starts_as_the_base_trains_adapters_only_and_merges():
    torch.manual_seed(0)
    model = _model()
    tokens = torch.randint(1, 257, (2, 12))
    before = model(tokens).detach()
    names = apply_lora(
        model,
        rank=4,
        alpha=8,
        targets=["q_proj", "v_proj"],
        seed=1,
        alias=lambda n: {"wq": "q_proj", "wv": "v_proj"}.get(n.rsplit(".", 1)[-1], ""),
    )
    assert names == ["layers.0.attention.wq", "layers.0.attention.wv", "layers.1.attention.wq", "layers.1.attention.wv"]
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)  # B = 0: exactly the base
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{w}" for n in names for w in ("lora_a", "lora_b")}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(3):
        model(tokens).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    after = model(tokens).detach()
    assert (after - before).abs().max() > 1e-4
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert set(adapter_state(full)) == trainable
    plain = _model()
    plain.load_state_dict(merged_state(full, scale=8 / 4))
    # Merging folds B A into W: fp32 rounding of one matmul (~1e-6) is all that may differ.
    torch.testing.assert_close(plain(tokens), after, rtol=0, atol=1e-5)
    merge_lora_(model)
    assert not any("lora" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model(tokens), after, rtol=0, atol=1e-5)


@pytest.mark.parametrize("field", ["train_file", "valid_file"])
def test_a_directory_given_as_records_is_named_a_directory_before_any_rank_starts(tmp_path, field):
    """An existing directory is not "missing": the one line says what it is and what to give."""
    from conftest import TINY, run_main

    records = tmp_path / "sft.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    folder = tmp_path / "records"
    folder.mkdir()
    files = {"train_file": records, "valid_file": records, field: folder}
    out = run_main(
        TINY
        + [
            "stage=fine_tuning",
            f"finetune.train_file={files['train_file']}",
            f"finetune.valid_file={files['valid_file']}",
        ]
        + [f"hydra.run.dir={tmp_path}/run"],
        tmp_path,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: finetune.{field}={folder} is a directory; give a JSONL file of "
        '{"prompt", "response"} or {"messages": [...]} records'
    ], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()  # refused before any rank started
    with pytest.raises(UserInputError, match=f"^finetune: {folder} is a directory; give a JSONL file"):
        read_records(str(folder))
