"""Generation from a causal LM, for users (`stage=generate`, the end-of-run sample) and for training
loops that need completions (rollouts):

    from framework.generation import generate
    done = generate(model, [tok.encode("def add("), tok.encode("x =")], max_new_tokens=64,
                    eos_ids=[tok.eod], stop_strings=["\\n\\n"], decode=tok.decode,
                    temperature=0.8, top_k=50, top_p=0.95, seed=7)
    done[0].token_ids, done[0].text, done[0].finish_reason     # "eos", "stop" or "length"

Prompts are batched (`batch_size` at a time) with left padding; each row stops at an end-of-text id
(`eos_ids`, kept as the completion's last token) or when its decoded completion holds a stop string
(the text is cut before it); the batch ends when every row has. Decoding uses a KV cache
(framework/generation/decoders.py); `use_cache=False` recomputes the whole sequence each step.

[Note: a prompt's completion does not depend on its batch]
Each prompt draws from a generator of its own, seeded with `seed + i` for the i-th prompt of the
call (or `seed[i]` when a list is given), on the CPU; greedy decoding (temperature 0) draws
nothing. Left padding changes neither the positions nor what a token attends to, so a prompt
generates the same tokens alone or in any batch (up to float rounding of the logits, which the
tests show does not change a token on our models).

On a sharded model (any engine) the whole call runs as one forward method of the root
(`register_fsdp_forward_method`): our engine gathers every unit once for the call and the forwards
inside communicate nothing (tensor parallelism's own collectives aside), so each rank may generate
for its own prompts and stop when they are done; torch's FSDP2 gathers each block at each forward,
so there every rank runs as many forwards as the busiest one (agreed by an all-reduce per step).
Under tensor parallelism the ranks of a tensor-parallel group must pass the same prompts and seeds
(they compute the same whole logits and so pick the same tokens).

[Note: generation with experts split]
Under expert parallelism (`parallelism.ep`) each rank holds only its share of every block's
experts, and a forward sends each token to the rank holding its expert by all-to-all
(framework/distributed/expert_parallel.py). Generation keeps that split and runs in lockstep:
every rank runs as many batches and decoding steps as the busiest one (the same all-reduce as
FSDP2's, a spare one-token prompt where a rank has no batch left, and its finished rows fed the
pad id), so each forward's all-to-all finds every rank of its group. The other way, gathering
every expert onto every rank for the call as the engine gathers the dense weights, would hold the
whole model's experts on each rank: the memory expert parallelism exists to save. With dropless
routing (capacity_factor=0) a token's expert output does not depend on the rows it travels with,
so a prompt's completion is the one it gets on one process (tests/finetune/test_grpo.py's expert
parallel runs draw the same completions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Union

import torch

from framework.generation.decoders import decoder_for, max_tokens

__all__ = ["Completion", "generate"]

_METHOD = "_framework_generation_call"


@dataclass(frozen=True)
class Completion:
    token_ids: List[int]  # the generated ids; an end-of-text id that stopped the row is the last
    text: Optional[str]  # decode(token_ids) cut before a stop string (and without the end id); None without decode
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max_new_tokens)


def _draw(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    from framework.models.tasks import next_token

    return next_token(logits, temperature, top_k, top_p, gen)


class _Row:
    def __init__(self, prompt: Sequence[int], seed: int, index: int = -1) -> None:
        self.prompt, self.index = list(prompt), index
        self.gen = torch.Generator().manual_seed(seed)
        self.out: List[int] = []
        self.text: Optional[str] = None
        self.reason: Optional[str] = None


def _finish(row: _Row, token: int, eos: set, stops: Sequence[str], decode, max_new_tokens: int) -> None:
    row.out.append(token)
    if token in eos:
        row.reason = "eos"
        return
    if stops:
        row.text = decode(row.out)
        cut = [row.text.find(s) for s in stops if s and s in row.text]
        if cut:
            row.text, row.reason = row.text[: min(cut)], "stop"
            return
    if len(row.out) >= max_new_tokens:
        row.reason = "length"


def _lockstep(flag: int, collective: bool) -> int:
    """The maximum of `flag` over every rank when the forwards communicate; else `flag`."""
    if not collective or not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    t = torch.tensor([flag], dtype=torch.long)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)  # gloo: a CPU tensor
    return int(t.item())


def _batch(model, rows: List[_Row], max_new_tokens: int, opts: dict, collective: bool) -> None:
    device = next(iter(model.parameters())).device
    longest = max(len(r.prompt) for r in rows)
    pad = opts["pad_id"]
    ids = torch.tensor([[pad] * (longest - len(r.prompt)) + r.prompt for r in rows], device=device)
    valid = torch.tensor([[False] * (longest - len(r.prompt)) + [True] * len(r.prompt) for r in rows], device=device)
    session = decoder_for(model, opts["use_cache"])
    logits = session.start(ids, valid, longest + max_new_tokens)
    greedy = opts["temperature"] == 0
    for step in range(max_new_tokens):
        picks = logits.argmax(-1).tolist() if greedy else None
        cpu = None if greedy else logits.cpu()
        for i, row in enumerate(rows):
            if row.reason is None:
                token = (
                    picks[i] if greedy else _draw(cpu[i], opts["temperature"], opts["top_k"], opts["top_p"], row.gen)
                )
                _finish(row, token, opts["eos"], opts["stops"], opts["decode"], max_new_tokens)
                if opts["on_token"] is not None:
                    opts["on_token"](row.index, row.out)
        busy = any(r.reason is None for r in rows)
        if not _lockstep(int(busy), collective) or step == max_new_tokens - 1:
            break
        following = [r.out[-1] if r.reason is None else pad for r in rows]
        logits = session.step(torch.tensor(following, device=device)[:, None])


@torch.no_grad()
def _generate(model, rows: List[_Row], max_new_tokens: int, opts: dict, collective: bool) -> None:
    size = opts["batch_size"] or max(len(rows), 1)  # no prompts: no batch of its own (spares only)
    batches = [rows[i : i + size] for i in range(0, len(rows), size)]
    # Collective forwards: every rank runs as many batches as the rank with the most (a spare
    # one-token prompt where it has none left).
    count = _lockstep(len(batches), collective)
    for i in range(count):
        batch = batches[i] if i < len(batches) else [_Row([opts["pad_id"]], 0)]
        _batch(model, batch, max_new_tokens, opts, collective)


def _experts_split(model) -> bool:
    """Whether `model`'s experts are split over expert-parallel ranks: [Note: generation with experts
    split]."""
    from framework.distributed.expert_parallel import ExpertDispatch, expert_groups

    return any(isinstance(m.dispatch, ExpertDispatch) and m.dispatch.size > 1 for m in expert_groups(model))


def _run_sharded(model, fn: Callable[[bool], None]) -> None:
    """fn(collective) as one forward method of a sharded `model` (see the module's docstring)."""
    from framework.distributed.engines import engine_sharding

    engine = engine_sharding(model)
    split = _experts_split(model)
    if engine is None:
        return fn(split)
    if not hasattr(model, _METHOD + "_collective"):
        setattr(model, _METHOD, lambda thunk: thunk())
        setattr(model, _METHOD + "_collective", engine.register_forward_method(model, _METHOD))
    collective = getattr(model, _METHOD + "_collective") or split
    with torch.no_grad():
        getattr(model, _METHOD)(lambda: fn(collective))


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Optional[Callable[[List[int]], str]] = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: Union[int, Sequence[int]] = 0,
    batch_size: int = 0,
    use_cache: bool = True,
    pad_id: Optional[int] = None,
    on_token: Optional[Callable[[int, List[int]], None]] = None,
) -> List[Completion]:
    """Completions of `prompts` (token ids), in their order. Sampling: temperature (0: greedy), then
    the top_k most likely (0: all), then the smallest head holding top_p of the mass; each prompt
    seeded on its own ([Note: a prompt's completion does not depend on its batch]). `batch_size`
    prompts run together (0: all). Stop strings need `decode`. `on_token(i, token_ids)` is called
    after each token prompt i gets (to stream it). Raises ValueError for prompts the
    model cannot take (empty, or longer with the completion than its positions allow)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}; give 1 or more")
    if stop_strings and decode is None:
        raise ValueError("stop_strings need decode=<token ids -> text>")
    seeds = [seed + i for i in range(len(prompts))] if isinstance(seed, int) else list(seed)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts; give one per prompt or an int")
    limit = max_tokens(model)
    for i, p in enumerate(prompts):
        if not len(p):
            raise ValueError(f"prompt {i} has no tokens")
        if limit is not None and len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens={max_new_tokens} exceed the model's {limit} positions"
            )
    eos = [int(e) for e in eos_ids]
    opts = dict(
        eos=set(eos),
        stops=list(stop_strings),
        decode=decode,
        temperature=float(temperature),
        top_k=int(top_k),
        top_p=float(top_p),
        batch_size=int(batch_size),
        use_cache=use_cache,
        pad_id=pad_id if pad_id is not None else (eos[0] if eos else 0),
        on_token=on_token,
    )
    rows = [_Row(p, s, i) for i, (p, s) in enumerate(zip(prompts, seeds))]
    was_training = model.training
    model.eval()
    try:
        _run_sharded(model, lambda collective: _generate(model, rows, max_new_tokens, opts, collective))
    finally:
        model.train(was_training)
    return [Completion(r.out, _text(r, decode), r.reason or "length") for r in rows]


def _text(row: _Row, decode) -> Optional[str]:
    if decode is None:
        return None
    if row.reason == "stop":
        return row.text
    return decode(row.out[:-1] if row.reason == "eos" else row.out)
