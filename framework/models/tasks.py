"""Tasks: how a batch becomes a loss, so one trainer serves every kind of model.

    loss = task.loss(model, batch)       # batch already on the device (see `to_device`)

A batch is what the data loader yields: a `(inputs, labels)` pair of token tensors for causal
language modelling, or a dict of tensors (`input_ids`, `labels`, `decoder_input_ids`, ...) for the
others. Labels equal to -100 are ignored (padding, prompt tokens in fine-tuning). Each loss is the
mean over the labelled positions of the micro-batch, in fp32. A model may return the logits or an
object with `.logits` (Hugging Face models); both are accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over every labelled position (their mean, or with "sum" their sum); logits
    (..., classes), labels (...)."""
    return F.cross_entropy(
        logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction
    )


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with its tensors on `device`. A host tensor bound for a GPU goes through pinned
    memory and is copied without the host waiting: a copy from pageable memory makes the host wait
    for the device every step ([Note: the host reads the device on log steps only] in
    framework/metrics.py)."""
    if isinstance(batch, torch.Tensor):
        if torch.device(device).type == "cuda" and batch.device.type == "cpu":
            return batch.pin_memory().to(device, non_blocking=True)
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _causal_lm_forward(model, batch) -> tuple:
    """(logits, labels) of a causal-LM batch: (inputs, labels), or a dict whose packed fine-tuning
    rows carry each token's position in its document and the document's id
    (framework/finetune/data.py); the model keeps attention inside each document."""
    if isinstance(batch, dict):
        packed = {k: batch[k] for k in ("positions", "document_ids") if k in batch}
        return logits_of(model(batch["input_ids"], **packed)), batch["labels"]
    inputs, labels = batch
    return logits_of(model(inputs)), labels


def _causal_lm(model, batch) -> torch.Tensor:
    return with_aux_loss(model, cross_entropy(*_causal_lm_forward(model, batch)))


def causal_lm_summed(model, batch) -> torch.Tensor:
    """The cross-entropy summed (not averaged) over the labelled positions of `batch`, which may be
    a chunk of each row (context parallelism: positions and document ids of the whole rows)."""
    return cross_entropy(*_causal_lm_forward(model, batch), reduction="sum")


def with_aux_loss(model, loss: torch.Tensor) -> torch.Tensor:
    """The loss plus a mixture-of-experts model's load-balancing loss of the same forward. Under
    context parallelism the trainer adds it to each cp rank's share of the loss as it is: with
    global-batch shares, the mean over the cp ranks of their chunks' terms is the micro-batch's."""
    aux = getattr(model, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        return loss
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(loss, DTensor) and not isinstance(aux, DTensor):
        # Tensor parallel's loss is a DTensor: the plain aux (the same on every tp rank, the router
        # being whole) joins it as a replicated one, so its backward receives a plain gradient.
        aux = DTensor.from_local(aux, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + aux


def _seq2seq(model, batch) -> torch.Tensor:
    # Without decoder_input_ids, a Hugging Face encoder-decoder shifts the labels right itself
    # (decoder_start_token_id first), which is the teacher-forcing input.
    kwargs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    for key in ("attention_mask", "decoder_input_ids", "decoder_attention_mask"):
        if key in batch:
            kwargs[key] = batch[key]
    return cross_entropy(logits_of(model(**kwargs)), batch["labels"])


@torch.no_grad()
def greedy_decode(model, batch, steps: int) -> torch.Tensor:
    """Greedy decoding of an encoder-decoder for exactly `steps` tokens (no early stop: every rank
    of a sharded model must run the same forwards). Returns (batch, steps) token ids."""
    config = getattr(model, "config", None)
    start = getattr(config, "decoder_start_token_id", None) or 0
    dec = torch.full((batch["input_ids"].shape[0], 1), start, dtype=torch.long, device=batch["input_ids"].device)
    kwargs = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
    for _ in range(steps):
        logits = logits_of(model(**kwargs, decoder_input_ids=dec))
        dec = torch.cat([dec, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return dec[:, 1:]


def _seq2seq_exact_match(model, batch) -> dict:
    """A generated target equals the labels up to and including its end token."""
    labels = batch["labels"]
    generated = greedy_decode(model, batch, labels.shape[1])
    same = ((generated == labels) | (labels == IGNORE_INDEX)).all(dim=1)
    return {"exact_match": (same.float().sum(), torch.tensor(float(labels.shape[0]), device=labels.device))}


def _sequence_classification(model, batch) -> torch.Tensor:
    kwargs = {"input_ids": batch["input_ids"]}
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    return cross_entropy(logits_of(model(**kwargs)), batch["labels"])


def _image_classification(model, batch) -> torch.Tensor:
    return cross_entropy(logits_of(model(batch["inputs"])), batch["labels"])


def _image_accuracy(model, batch) -> dict:
    correct = (logits_of(model(batch["inputs"])).argmax(-1) == batch["labels"]).sum()
    return {"acc": (correct.float(), torch.tensor(float(batch["labels"].numel()), device=correct.device))}


@dataclass(frozen=True)
class RunView:
    """What a task's end-of-run hook may use of the finished job."""

    model: Any
    data: Any  # the DataBundle: loaders and the tokenizer
    device: torch.device
    seed: int
    seq_len: int
    sample_tokens: int  # trainer.sample_tokens
    gather: Callable[[torch.Tensor], torch.Tensor]  # a tensor-parallel shard -> the full tensor
    # framework.generation.generate, which the trainer passes (a layer above the models)
    generate: Optional[Callable[..., list]] = None


def next_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token id from the last position's logits (float32, on the CPU): temperature (0:
    greedy), then the top_k most likely (0: all), then the smallest head holding top_p of the mass."""
    if temperature == 0:
        return int(torch.argmax(logits))
    # Shifted so the largest is 0 before dividing: a tiny temperature sends the others to -inf
    # (mass 0) instead of the largest to +inf (softmax of inf is nan).
    logits = (logits - logits.max()) / temperature
    if top_k:
        values, indices = torch.topk(logits, min(top_k, logits.numel()))
    else:
        values, indices = torch.sort(logits, descending=True)
    probs = F.softmax(values, -1)
    if top_p < 1:
        keep = torch.cumsum(probs, -1) - probs < top_p
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return int(indices[torch.multinomial(probs, 1, generator=gen)])


PROMPT_TOKENS = 16  # the end-of-run sample's prompt: at most this many tokens of the data


def data_prompt(data, eod: Optional[int], tokens: int = PROMPT_TOKENS, prefix: Sequence[int] = ()) -> Optional[list]:
    """A prompt from the data's own text: the first sample of the validation split (else the
    training split's), the same on every rank. Of a fine-tuning record, its prompt (the tokens
    before the first labelled one; its last `tokens`, after the tokenizer's `prefix`, its BOS, when
    the record starts with it); of pre-training text, at most `tokens` tokens of one document (after
    an end-of-text in the sample's first half, so it starts a document, with its BOS where the data
    has one). None: no sample."""
    prefix = list(prefix)
    for loader in (data.valid, data.train):
        try:
            sample = loader.source[0]
        except (AttributeError, IndexError, KeyError, TypeError):  # no indexable source, or an empty one
            continue
        if isinstance(sample, dict):
            ids, labels = [int(t) for t in sample["input_ids"]], sample.get("labels")
            if labels is not None:
                learnt = [i for i, label in enumerate(labels.tolist()) if label != IGNORE_INDEX]
                ids = ids[: learnt[0] + 1] if learnt else ids
        else:
            ids = [int(t) for t in sample]
        if eod is not None and eod in ids[: len(ids) // 2]:
            ids = ids[ids.index(eod) + 1 :]
        if eod is not None and eod in ids:
            ids = ids[: ids.index(eod)]
        if not ids:
            continue
        if not isinstance(sample, dict):
            return ids[:tokens]
        if prefix and ids[: len(prefix)] == prefix and len(ids) > tokens:  # the record's BOS stays first
            return prefix + ids[len(prefix) :][-max(tokens - len(prefix), 1) :]
        return ids[-tokens:]
    return None


@torch.no_grad()
def _causal_lm_sample(run: RunView) -> Optional[str]:
    """Text generated from a prompt of the data's own text (`data_prompt`) by top-k sampling
    (framework/generation: KV cache, stop at end-of-text). Every rank generates from the same
    prompt with the same seed, so tensor-parallel ranks agree on each token; rank 0 shows it."""
    tok = run.data.tokenizer
    eod = getattr(tok, "eod", None)
    prefix = list(getattr(tok, "special_prefix", []))  # the tokenizer's BOS, where it adds one
    prompt = data_prompt(run.data, eod, prefix=prefix)
    if not run.sample_tokens or run.generate is None or prompt is None:
        return None
    new = min(run.sample_tokens, run.seq_len - len(prompt))  # within the positions the model trained on
    if new < 1:
        return None
    done = run.generate(
        run.model, [prompt], new, eos_ids=[eod] if eod is not None else [], temperature=0.8, top_k=20, seed=[run.seed]
    )[0]
    ids = done.token_ids[:-1] if done.finish_reason == "eos" else done.token_ids
    shown = prompt[len(prefix) :] if prefix and prompt[: len(prefix)] == prefix else prompt  # not the BOS
    return "--- sample ---\n" + tok.decode(shown + ids) + "\n--------------"


@torch.no_grad()
def _seq2seq_examples(run: RunView, count: int = 4) -> str:
    """Source, expected and generated text of the first validation samples of this rank."""
    model, loader, tokenizer = run.model, run.data.valid, run.data.tokenizer
    model.eval()
    loader.load_state_dict({"consumed_samples": 0})
    batch = to_device(loader.next_batch(), run.device)
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


@dataclass(frozen=True)
class Task:
    name: str
    loss: Callable[[Any, Any], torch.Tensor]  # (model, batch on the device) -> scalar mean loss
    # What data=synthetic yields for it: "tokens" (seq_len + 1 ids), "seq2seq" (source/target
    # pairs), "sequence_label" (ids and a class), "image_label" (a tensor and a class).
    sample_kind: str = "tokens"
    # Evaluation numbers besides the loss: (model, batch) -> {name: (sum, count)}; the trainer sums
    # both over the whole validation split and the ranks and logs sum / count as `val_<name>`.
    metrics: Callable[[Any, Any], dict] | None = None
    # Shown when training ends, if the data has a tokenizer: (RunView) -> text for the log, or None.
    end_of_run: Callable[[RunView], Optional[str]] | None = None
    # (model, batch or a chunk of its rows) -> loss summed over the labelled positions: what context
    # parallelism needs (None: the task does not split sequences)
    summed_loss: Callable[[Any, Any], torch.Tensor] | None = None


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    _TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in _TASKS:
        from framework.errors import UserInputError

        raise UserInputError(f"model.task={name!r}: unknown; choose one of {', '.join(sorted(_TASKS))}")
    return _TASKS[name]


for _task in (
    Task("causal_lm", _causal_lm, end_of_run=_causal_lm_sample, summed_loss=causal_lm_summed),
    Task("seq2seq", _seq2seq, "seq2seq", _seq2seq_exact_match, _seq2seq_examples),
    Task("sequence_classification", _sequence_classification, "sequence_label"),
    Task("image_classification", _image_classification, "image_label", _image_accuracy),
):
    register_task(_task)
