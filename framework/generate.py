"""`stage=generate`: text from a trained model, streamed to the terminal.

    python main.py stage=generate checkpoint.resume=runs/exp1/checkpoints/step_00000100 \\
        'generate.prompts=["def add(a, b):"]' generate.max_new_tokens=40 cluster.nproc_per_node=1

The model, its sharding and the tokenizer are built as for training from the same config (the job of
framework/job.py; no optimizer is built); the weights come from `checkpoint.resume` (a DCP step
directory, resharded to this world size, so a checkpoint of 2 ranks loads on 1) or
`checkpoint.init_from` / `model.path` (an export). Every rank generates for every prompt
(tensor-parallel ranks need the same ones) through framework/generation: generate.batch_size prompts
at a time (left-padded, one KV cache); each stops at the tokenizer's end-of-text, before the first
of generate.stop_strings, or after max_new_tokens. Rank 0 prints each prompt and its completion,
streamed a token at a time when a batch is one prompt, and writes them to generate.output_file (JSON
lines) if named. Sampling: temperature (0: greedy), then top-k, then top-p, each prompt from its own
generator (generate.seed + its index in the job), so a prompt's text does not depend on the batch
size.
"""

from __future__ import annotations

import sys
from typing import List

from framework.config.schema import Config
from framework.errors import UserInputError
from framework.preflight import generate_output_problem


def prompts_of(cfg: Config) -> List[str]:
    g = cfg.generate
    prompts = list(g.prompts)
    if g.prompt_file:
        try:
            with open(g.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"generate.prompt_file={g.prompt_file}: cannot be read ({exc})") from None
    if not prompts:
        raise UserInputError(
            "stage=generate needs generate.prompts=[...] or generate.prompt_file=<one prompt per line>"
        )
    return prompts


class _Stream:
    """Rank 0's terminal view of one completion while it decodes: the text so far, less any tail
    that may yet turn out to begin a stop string or is an unfinished character (held back until it
    cannot), so what is printed is always a prefix of the final text, which the stop strings cut."""

    def __init__(self, decode, eod, stops: List[str], show: bool) -> None:
        self.decode, self.eod, self.stops, self.show = decode, eod, stops, show
        self.shown = ""

    def _safe(self, text: str) -> str:
        # a trailing U+FFFD is a multi-byte character whose bytes are not all decoded yet: shown
        # now, the text would stop being a prefix of what follows and the stream would stall
        text = text.rstrip("\ufffd")
        cut = [text.find(s) for s in self.stops if s in text]
        if cut:
            return text[: min(cut)]
        for keep in range(max((len(s) for s in self.stops), default=1) - 1, 0, -1):
            if any(s.startswith(text[-keep:]) for s in self.stops if len(s) > keep):
                return text[:-keep]
        return text

    def _print(self, text: str) -> None:
        if text.startswith(self.shown) and len(text) > len(self.shown):
            if self.show:
                print(text[len(self.shown) :], end="", flush=True)
            self.shown = text

    def __call__(self, _index: int, out: List[int]) -> None:
        self._print(self._safe(self.decode([t for t in out if t != self.eod])))

    def end(self, final: str) -> None:
        self._print(final)


def _without_prefix(ids: List[int], tok) -> List[int]:
    """The prompt's ids without the special tokens the tokenizer put first (a BOS): what is shown."""
    prefix = list(getattr(tok, "special_prefix", []))
    return ids[len(prefix) :] if prefix and ids[: len(prefix)] == prefix else ids


def generate(job, prompts: List[str], is_main: bool) -> List[dict]:
    """Every rank: the prompts' completions through framework/generation (KV cache, stop at the
    tokenizer's end-of-text or a stop string), `generate.batch_size` prompts at a time; rank 0
    prints each prompt with its completion, streamed a token at a time when the batch is one
    prompt. Returns one record per prompt: prompt, completion, finish_reason, new_tokens."""
    from framework.generation import generate as complete
    from framework.generation.decoders import max_tokens

    g = job.cfg.generate
    tok, model = job.data.tokenizer, job.model
    ids = []
    for prompt in prompts:  # as `tokenizer(prompt)` encodes it: its BOS first, where it adds one
        ids.append(list(tok.encode(prompt, specials=True)))
        if not ids[-1]:
            raise UserInputError(f"generate: the prompt {prompt[:40]!r} has no tokens")
    limit = max_tokens(model)
    longest = max(len(i) for i in ids)
    if limit is not None and longest + g.max_new_tokens > limit:
        raise UserInputError(
            f"generate.max_new_tokens={g.max_new_tokens}: with the longest prompt ({longest} tokens) it exceeds the "
            f"model's {limit} positions; lower it to {max(limit - longest, 0)} or shorten the prompt"
        )
    eod = getattr(tok, "eod", None)
    stops = list(g.stop_strings)
    records = []
    for start in range(0, len(ids), g.batch_size):
        batch = ids[start : start + g.batch_size]
        texts = [tok.decode(_without_prefix(p, tok)) for p in batch]
        stream = None
        if len(batch) == 1:
            stream = _Stream(tok.decode, eod, stops, is_main)
            if is_main:
                print(texts[0], end="", flush=True)
        done = complete(
            model,
            batch,
            g.max_new_tokens,
            eos_ids=[eod] if eod is not None else [],
            stop_strings=stops,
            decode=tok.decode,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            seed=[g.seed + start + j for j in range(len(batch))],  # a prompt's seed: its place in the job
            on_token=stream,
        )
        for text, c in zip(texts, done):
            if stream is not None:
                stream.end(c.text)
            elif is_main:
                print(text + c.text, end="", flush=True)
            if is_main:
                print(flush=True)
            records.append(
                {"prompt": text, "completion": c.text, "finish_reason": c.finish_reason, "new_tokens": len(c.token_ids)}
            )
    return records


def write_records(path: str, records: List[dict]) -> None:
    """The completions as JSON lines, written whole (framework/fileio.py: never through a link)."""
    import json

    from framework.fileio import replace_file

    try:
        with replace_file(path) as f:  # on failure the temporary is removed and `path` never made
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    except OSError as exc:  # a full disk, a directory made read-only or removed since the start
        raise UserInputError(
            f"generate.output_file={path}: cannot be written ({exc.strerror or exc}); the completions are "
            "printed above, nothing was written"
        ) from None


def generate_stage(job) -> int:
    """The stage on a built job (every rank): load the weights, generate. Refusals raise."""
    from framework.job import load_trained_weights

    cfg = job.cfg
    prompts = prompts_of(cfg)
    if cfg.parallelism.sequence_parallel and cfg.parallelism.tp > 1:  # found before the ranks started too
        from framework.config.validate import GENERATE_SEQUENCE_PARALLEL

        raise UserInputError(GENERATE_SEQUENCE_PARALLEL)
    if job.data.tokenizer is None:
        raise UserInputError(
            "stage=generate needs a tokenizer: the data's (data=stdlib, data.tokenizer=<tokenizer.json>) "
            "or the model directory's"
        )
    problem = generate_output_problem(cfg)  # found before the ranks started too; here for direct callers
    if problem:
        raise UserInputError(problem)
    step = load_trained_weights(job, "generate")
    if job.rt.is_main:
        print(f"generating from {'step ' + str(step) if step else 'the imported weights'}", file=sys.stderr)
    records = generate(job, prompts, job.rt.is_main)
    if cfg.generate.output_file and job.rt.is_main:
        write_records(cfg.generate.output_file, records)
        print(f"wrote {len(records)} completions to {cfg.generate.output_file}", file=sys.stderr)
    return 0
