"""`stage=generate`: text from a trained model, streamed to the terminal.

    python main.py stage=generate checkpoint.resume=runs/exp1/checkpoints/step_00000100 \\
        'generate.prompts=["def add(a, b):"]' generate.max_new_tokens=40 cluster.nproc_per_node=1

The model, its sharding and the tokenizer are built as for training from the same config; the
weights come from `checkpoint.resume` (a DCP step directory, resharded to this world size, so a
checkpoint of 2 ranks loads on 1) or `checkpoint.init_from` / `model.path` (an export). Every rank
generates for every prompt (tensor-parallel ranks need the same ones) through framework/generation:
one prompt after another, with a KV cache; each stops at the tokenizer's end-of-text or after
max_new_tokens. Rank 0 streams each prompt and its completion, a token at a time. Sampling:
temperature (0: greedy), then top-k, then top-p, each prompt from its own generator (generate.seed
+ its index).
"""

from __future__ import annotations

import sys
from typing import List

from framework.config.schema import Config
from framework.errors import UserInputError


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


def generate(trainer, prompts: List[str], is_main: bool) -> List[str]:
    """Every rank: the prompts' completions through framework/generation (KV cache, stop at the
    tokenizer's end-of-text), one prompt after another; rank 0 streams each prompt with its
    completion. Returns the texts (prompt and completion)."""
    from framework.generation import generate as complete
    from framework.generation.decoders import max_tokens

    g = trainer.cfg.generate
    tok, model = trainer.data.tokenizer, trainer.model
    ids = []
    for prompt in prompts:
        ids.append(list(tok.encode(prompt)))
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
    texts = []
    for i, prompt_ids in enumerate(ids):
        shown = [tok.decode(prompt_ids)]
        if is_main:
            print(shown[0], end="", flush=True)

        def stream(_, out, prompt_ids=prompt_ids, shown=shown):
            text = tok.decode(prompt_ids + [t for t in out if t != eod])
            if is_main:
                print(text[len(shown[0]) :], end="", flush=True)  # what the new token added
            shown[0] = text

        complete(
            model,
            [prompt_ids],
            g.max_new_tokens,
            eos_ids=[eod] if eod is not None else [],
            decode=tok.decode,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p,
            seed=[g.seed + i],
            on_token=stream,
        )
        if is_main:
            print(flush=True)
        texts.append(shown[0])
    return texts


def _generate_stage(trainer) -> int:
    """The stage on a built trainer (every rank): load the weights, generate. Refusals raise."""
    cfg = trainer.cfg
    prompts = prompts_of(cfg)
    if cfg.parallelism.sequence_parallel and cfg.parallelism.tp > 1:
        raise UserInputError(
            "stage=generate with parallelism.sequence_parallel=true: decoding feeds one token at a time, which "
            "cannot be split over the tp ranks; set parallelism.sequence_parallel=false (tp stays)"
        )
    if trainer.data.tokenizer is None:
        raise UserInputError(
            "stage=generate needs a tokenizer: the data's (data=stdlib, data.tokenizer=<tokenizer.json>) "
            "or the model directory's"
        )
    step = trainer.load_weights("generate")
    if trainer.rt.is_main:
        print(f"generating from {'step ' + str(step) if step else 'the imported weights'}", file=sys.stderr)
    generate(trainer, prompts, trainer.rt.is_main)
    trainer.ckpt.close()
    return 0


def run_generate(cfg: Config, record=None) -> int:
    """Every rank: the training job's build and failure handling (`run` in framework/trainer.py), with
    generation in place of training; rank 0 then `record`s the job's config. Exit status."""
    from framework.trainer import run

    return run(cfg, body=_generate_stage, record=record)
