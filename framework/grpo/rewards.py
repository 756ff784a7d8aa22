"""The rewards of `stage=grpo`: built-in functions of a completion, and a function of the user's own.

[Note: the GRPO rewards]
A completion's reward is the weighted sum (grpo.reward_weights, default 1 each) of
- exact_match: 1 when the answer extracted from the completion's text (the first group of
  grpo.answer_regex, or its whole match when it has no group) equals the record's answer
  (grpo.answer_field) as text, both stripped of surrounding spaces; else 0 (no match: 0);
- format: 1 when grpo.format_regex matches the completion's text (re.search), else 0;
- length: 1 - |n - grpo.length_target| / grpo.length_target, at least 0, n the completion's tokens
  (its end-of-text included);
- the user's function (grpo.reward_module="pkg.module:fn" or "path/file.py:fn"), loaded only with
  grpo.trust_reward_code=true, called as TRL calls a reward function:
  fn(prompts=..., completions=..., completion_ids=..., **columns) -> one number per completion,
  all lists with one entry per completion (a prompt's group adjacent): `prompts` the records' prompt
  column as given (a string, or chat turns: a list of {role, content}); `completions` the
  completions' texts, or for chat prompts each a one-turn conversation
  [{"role": "assistant", "content": text}]; `completion_ids` their token ids (the end-of-text
  included when sampled); and every other column of the records by its name. A function written
  for TRL's GRPOTrainer (`def fn(completions, **kwargs)`) runs unchanged. It runs the user's code
  in every rank. Its signature is checked when it is loaded (and against the records' columns on
  its first call): one that cannot take those keywords (the earlier form fn(prompts, completions,
  answers)) is refused in one `error:` line (status 2) before training. A function that raises is
  the user's code failing: its traceback is shown and the job exits with status 1 on every rank.
  It returns one finite number or None per completion; None is TRL's "not applicable": NaN, left out
  of the weighted sum (TRL's nansum), and a completion that every reward leaves out has no reward
  (NaN: out of its group's mean and std, advantage 0). Anything else ends the job in one `error:`
  line (status 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
from typing import Callable, List, Optional, Sequence

from framework.config.grpo import GRPOConfig
from framework.errors import UserInputError


def extract_answer(text: str, regex: str) -> Optional[str]:
    found = re.search(regex, text)
    if found is None:
        return None
    return found.group(1) if found.re.groups else found.group(0)


def exact_match(text: str, answer: str, regex: str) -> float:
    got = extract_answer(text, regex)
    return float(got is not None and got.strip() == answer.strip())


def format_reward(text: str, regex: str) -> float:
    return float(re.search(regex, text) is not None)


def length_reward(tokens: int, target: int) -> float:
    return max(0.0, 1.0 - abs(tokens - target) / target)


def load_reward_function(spec: str) -> Callable:
    """The user's function named by grpo.reward_module (its code runs: only with trust_reward_code)."""
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise UserInputError(f"grpo.reward_module={spec!r}: no such file {where}")
            loaded = importlib.util.spec_from_file_location("grpo_user_reward", where)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except UserInputError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module failed to load: their input
        raise UserInputError(f"grpo.reward_module={spec!r}: loading it raised {type(exc).__name__}: {exc}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserInputError(f"grpo.reward_module={spec!r}: {where} has no function {name!r}")
    return fn


# The keywords a reward function is called with besides the records' columns (TRL's GRPOTrainer's)
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")


def check_calling_form(fn: Callable, spec: str, columns: Optional[Sequence[str]] = None) -> None:
    """Refuse in one line a function that cannot be called as TRL calls a reward function: with
    CALL_KEYWORDS (when loaded), then with the records' `columns` too (on the first call)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
        return
    given = dict.fromkeys((*CALL_KEYWORDS, *(columns or ())))
    try:
        if columns is None:
            signature.bind_partial(**given)
        else:
            signature.bind(**given)
    except TypeError as exc:
        name = getattr(fn, "__name__", "the function")
        raise UserInputError(
            f"grpo.reward_module={spec!r}: {name}{signature} cannot be called as a reward function is now ({exc}): "
            "write it in TRL's form fn(prompts, completions, completion_ids, **kwargs), each other column of the "
            "records a keyword argument by its name (answer, ...); the earlier form fn(prompts, completions, "
            "answers) is no longer called"
        ) from None


class Rewards:
    """Scores completions by [Note: the GRPO rewards]."""

    def __init__(self, cfg: GRPOConfig, prompt_field: str = "prompt"):
        self.cfg = cfg
        self.prompt_field = prompt_field  # the records' prompt column (data.hf.prompt_field)
        self.user = load_reward_function(cfg.reward_module) if cfg.reward_module else None
        if self.user is not None:
            check_calling_form(self.user, cfg.reward_module)
        self._checked = set()  # the column sets the user's function was checked against
        count = len(cfg.rewards) + (self.user is not None)
        self.weights = cfg.reward_weights or [1.0] * count
        self.names = list(cfg.rewards) + (["user"] if self.user is not None else [])
        self.last: dict = {}

    def __call__(self, prompts: Sequence, texts: Sequence[str], token_ids: Sequence[Sequence[int]]) -> List[float]:
        """The completions' rewards: `prompts` (framework/grpo/data.py's Prompt) one per completion."""
        c = self.cfg
        columns = []
        for name in c.rewards:
            if name == "exact_match":
                columns.append([exact_match(t, p.answer, c.answer_regex) for t, p in zip(texts, prompts)])
            elif name == "format":
                columns.append([format_reward(t, c.format_regex) for t in texts])
            else:
                columns.append([length_reward(len(ids), c.length_target) for ids in token_ids])
        if self.user is not None:
            columns.append(self._user(prompts, list(texts), token_ids))
        self.last = dict(zip(self.names, columns))  # each reward's own scores, unweighted (for the metrics)
        return combine(columns, self.weights)

    def _user(self, prompts: Sequence, texts: list, token_ids: Sequence[Sequence[int]]) -> List[float]:
        """The user's function called as TRL's GRPOTrainer calls one. What it raises propagates: the
        user's code failing, with its traceback."""
        spec, field = self.cfg.reward_module, self.prompt_field
        records = [p.record or {field: p.text} for p in prompts]
        given = [r.get(field, p.text) for r, p in zip(records, prompts)]
        chat = [isinstance(g, list) for g in given]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
        reserved = (field, "prompts", "completions", "completion_ids")  # the columns that are not passed as such
        names = [k for k in dict.fromkeys(k for r in records for k in r) if k not in reserved]
        kwargs = {name: [r.get(name) for r in records] for name in names}
        if tuple(names) not in self._checked:
            check_calling_form(self.user, spec, names)
            self._checked.add(tuple(names))
        out = self.user(prompts=given, completions=completions, completion_ids=[list(i) for i in token_ids], **kwargs)
        try:
            values = [math.nan if v is None else float(v) for v in out]  # None: not applicable (NaN, as TRL)
        except (TypeError, ValueError):
            values = []
        given = [v for v, raw in zip(values, out) if raw is not None]
        if len(values) != len(texts) or not all(math.isfinite(v) for v in given):
            raise UserInputError(
                f"grpo.reward_module={spec!r} returned {str(out)[:80]!r}; return one finite number (or None: not "
                f"applicable) per completion ({len(texts)})"
            )
        return values


def combine(columns: Sequence[Sequence[float]], weights: Sequence[float]) -> List[float]:
    """Each completion's weighted sum of its rewards, NaN (None: not applicable) left out, as TRL's
    nansum; NaN when every reward left it out (TRL's unscorable completion)."""
    out = []
    for i in range(len(columns[0]) if columns else 0):
        terms = [w * col[i] for w, col in zip(weights, columns) if not math.isnan(col[i])]
        out.append(sum(terms) if terms else math.nan)
    return out
