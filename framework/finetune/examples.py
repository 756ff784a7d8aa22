"""Generated examples printed at the end of a sequence-to-sequence job (e.g. t5_docstrings)."""

from __future__ import annotations

import torch

from framework.models.tasks import IGNORE_INDEX, greedy_decode, to_device


@torch.no_grad()
def seq2seq_examples(model, loader, tokenizer, device, count: int = 4) -> str:
    """Source, expected and generated text of the first validation samples of this rank. Every
    rank must call it (the sharded model's forwards are collective)."""
    model.eval()
    loader.load_state_dict({"consumed_samples": 0})
    batch = to_device(loader.next_batch(), device)
    generated = greedy_decode(model, batch, batch["labels"].shape[1])
    model.train()
    eod = getattr(tokenizer, "eod", 0)

    def text(ids) -> str:
        ids = [int(i) for i in ids if int(i) != IGNORE_INDEX]
        return tokenizer.decode(ids[: ids.index(eod)] if eod in ids else ids).strip()

    lines = []
    for i in range(min(count, batch["labels"].shape[0])):
        source = [int(t) for t, m in zip(batch["input_ids"][i], batch["attention_mask"][i]) if m]
        first_line = text(source).splitlines()[0] if text(source) else ""
        lines += [
            f"--- example {i + 1}: {first_line}",
            f"expected:  {text(batch['labels'][i])}",
            f"generated: {text(generated[i])}",
        ]
    return "\n".join(lines)
