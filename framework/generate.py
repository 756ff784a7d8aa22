"""`stage=generate`: text from a trained model, streamed to the terminal.

    python main.py stage=generate checkpoint.resume=runs/exp1/checkpoints/step_00000100 \\
        'generate.prompts=["def add(a, b):"]' generate.max_new_tokens=40 cluster.nproc_per_node=1

The model, its sharding and the tokenizer are built as for training from the same config; the
weights come from `checkpoint.resume` (a DCP step directory, resharded to this world size, so a
checkpoint of 2 ranks loads on 1) or `checkpoint.init_from` / `model.path` (an export). Every rank
runs the same forwards (the sharded model needs them all) with the same seeded generator, so all
agree on each token; rank 0 prints. Sampling: temperature (0: greedy), then top-k, then top-p.
"""

from __future__ import annotations

import sys
from typing import List

import torch

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


@torch.no_grad()
def generate(trainer, prompts: List[str], is_main: bool) -> List[str]:
    from framework.distributed.tensor_parallel import full
    from framework.models.tasks import next_token

    cfg, g = trainer.cfg, trainer.cfg.generate
    tok, model, device = trainer.data.tokenizer, trainer.model, trainer.rt.device
    model.eval()
    gen = torch.Generator().manual_seed(g.seed)
    texts = []
    for prompt in prompts:
        ids = list(tok.encode(prompt))
        if not ids:
            raise UserInputError(f"generate: the prompt {prompt[:40]!r} has no tokens")
        shown = tok.decode(ids)
        if is_main:
            print(shown, end="", flush=True)
        for _ in range(g.max_new_tokens):
            out = model(torch.tensor([ids[-cfg.data.seq_len :]], device=device))
            logits = full(getattr(out, "logits", out))[0, -1].float().cpu()
            ids.append(next_token(logits, g.temperature, g.top_k, g.top_p, gen))
            text = tok.decode(ids)
            if is_main:
                print(text[len(shown) :], end="", flush=True)  # stream: what the new token added
            shown = text
        if is_main:
            print(flush=True)
        texts.append(shown)
    return texts


def _generate_stage(trainer) -> int:
    """The stage on a built trainer (every rank): load the weights, generate. Refusals raise."""
    cfg = trainer.cfg
    prompts = prompts_of(cfg)
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
