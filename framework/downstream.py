"""Downstream evaluation with lm-eval-harness: the model as an lm-eval `LM`, and running tasks on
it. Used by `stage=evaluate` (framework/evaluate.py) and by training's trainer.eval_tasks.

    python main.py stage=evaluate checkpoint.init_from=runs/exp1/checkpoints/export \\
        'evaluate.tasks=[my_task]' evaluate.include_path=tasks/ evaluate.num_fewshot=2

The model, its sharding and tokenizer are built as for training; the weights come from
`checkpoint.resume` (a step directory of any world size) or `checkpoint.init_from` / `model.path`
(an export). `ShardedLM` answers lm-eval's requests with our model: every rank runs lm-eval on the
same requests in the same order, so each forward of the sharded model is issued by all ranks (as
the engine needs), and all ranks get the same numbers; rank 0 prints the table, writes
`<run>/eval/results_step_N.json` and logs `eval/<task>/<metric>` to the trackers.

Tasks are lm-eval's task names; `evaluate.include_path` adds a directory of task YAMLs, which is how
a task over local data (a JSONL file: `dataset_path: json`, `dataset_kwargs.data_files`) runs on a
machine without a dataset hub. Tasks that need a download fail inside lm-eval and are refused in one
line naming the task.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from framework.errors import UserInputError


def _lm_eval():
    from framework.offline import hub_offline

    hub_offline()  # [Note: offline whatever the environment says]
    try:
        import lm_eval
        from lm_eval.api.model import LM
    except ImportError as exc:
        raise UserInputError(
            f"evaluation needs the lm-eval package ({exc}): pip install -r requirements-tools.lock "
            "(make venv installs it)"
        ) from None
    return lm_eval, LM


def make_sharded_lm(job, batch_size: int, max_gen_tokens: int):
    """An lm-eval `LM` over the job's (sharded) model and tokenizer."""
    _, LM = _lm_eval()
    tok, device, seq_len = job.data.tokenizer, job.rt.device, job.cfg.data.seq_len
    p = job.cfg.parallelism
    # sequence parallelism cuts every row into tp equal pieces: rows padded to a multiple of tp
    multiple = p.tp if p.sequence_parallel and p.tp > 1 else 1

    class ShardedLM(LM):
        def __init__(self):
            super().__init__()

        @torch.no_grad()
        def _log_probs(self, rows: List[List[int]]) -> torch.Tensor:
            """log-softmax of the model's logits for right-padded rows: (batch, length, vocab), the
            length a multiple of `multiple`. The model is causal: a row's positions never see the
            padding after it, and only a row's own positions are read."""
            length = -(-max(len(r) for r in rows) // multiple) * multiple
            batch = torch.full((len(rows), length), tok.eod, dtype=torch.long)
            for i, r in enumerate(rows):
                batch[i, : len(r)] = torch.tensor(r)
            return F.log_softmax(job.runner.logits(batch.to(device)), dim=-1).cpu()  # a pipeline's too

        def _score(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
            results: List[Tuple[float, bool]] = []
            for start in range(0, len(pairs), batch_size):
                chunk = pairs[start : start + batch_size]
                rows, spans = [], []
                for context, target in chunk:
                    ids = (context + target)[-(seq_len + 1) :]
                    rows.append(ids[:-1])
                    spans.append((len(ids) - 1 - len(target), len(target)))
                logp = self._log_probs(rows)
                for i, (first, n) in enumerate(spans):
                    target = torch.tensor(chunk[i][1])
                    picked = logp[i, first : first + n]
                    score = picked.gather(-1, target[:, None]).sum().item()
                    results.append((score, bool((picked.argmax(-1) == target).all())))
            return results

        def loglikelihood(self, requests):
            pairs = []
            for request in requests:
                context, continuation = request.args
                context_ids = list(tok.encode(context)) if context else [tok.eod]
                pairs.append((context_ids, list(tok.encode(continuation))))
            return self._score(pairs)

        def loglikelihood_rolling(self, requests):
            out = []
            for request in requests:
                ids = [tok.eod] + list(tok.encode(request.args[0]))  # every token after the first predicted
                total = 0.0
                for a in range(1, len(ids), seq_len):  # windows of seq_len targets, each with the context before it
                    b = min(a + seq_len, len(ids))
                    total += self._score([(ids[max(0, b - 1 - seq_len) : a], ids[a:b])])[0][0]
                out.append(total)
            return out

        @torch.no_grad()
        def generate_until(self, requests):
            out = []
            for request in requests:
                context, kwargs = request.args
                until = [u for u in (kwargs.get("until") or []) if u]
                limit = int(kwargs.get("max_gen_toks", max_gen_tokens))
                ids = list(tok.encode(context)) or [tok.eod]
                new: List[int] = []
                text = ""
                for _ in range(limit):
                    row = (ids + new)[-seq_len:]
                    token = int(self._log_probs([row])[0, len(row) - 1].argmax())  # its last, not a pad's
                    if token == tok.eod:
                        break
                    new.append(token)
                    text = tok.decode(new)
                    if any(u in text for u in until):
                        break
                for u in until:
                    text = text.split(u)[0]
                out.append(text)
            return out

    return ShardedLM()


_MANAGERS: dict = {}


def _task_manager(task_manager_type, include_path: str, tasks: List[str]):
    """lm-eval's task index over the folders that hold `tasks`, built once per process: the local
    tasks of `include_path`, and the folder of each built-in task asked for (found as
    framework/task_files.py finds it: [Note: indexing lm-eval's tasks without lm-eval]). lm-eval's
    whole index (~14,000 files, 12-47 s in every rank) only for a built-in group or tag, whose
    members may lie anywhere."""
    from framework.task_files import builtin_index, task_index

    local = task_index([include_path]) if include_path else {}
    folders: Optional[set] = set()
    for name in tasks:
        entry = None if name in local else builtin_index().get(name)
        if entry is not None and entry.kind in ("task", "python task"):
            folders.add(os.path.dirname(entry.path))
        elif name not in local:
            folders = None  # a group, a tag or an unknown name: lm-eval's whole index decides
            break
    key = (include_path, None if folders is None else tuple(sorted(folders)))
    if key not in _MANAGERS:
        if folders is None:
            _MANAGERS[key] = task_manager_type(include_path=include_path or None)
        else:  # lm-eval's order: its own folders first, include_path's tasks replacing theirs
            roots = [*sorted(folders), *([include_path] if include_path else [])]
            _MANAGERS[key] = task_manager_type(include_path=roots, include_defaults=False)
    return _MANAGERS[key]


@contextlib.contextmanager
def _sandboxed_templates(trusted: bool):
    """lm-eval renders every task template through one module-level Jinja environment
    (`lm_eval.utils.env`, read by `apply_template` at each call). Unless the task files are trusted,
    it is a sandboxed copy (the same settings and filters) while our evaluation runs, and lm-eval's
    own again after: a template cannot reach Python's internals, not even through a key computed
    at run time that no reading of the file can see ([Note: task files that run code] in
    framework/task_files.py)."""
    if trusted:
        yield
        return
    from jinja2.sandbox import SandboxedEnvironment
    from lm_eval import utils

    own = utils.env
    sandboxed = SandboxedEnvironment(undefined=own.undefined, keep_trailing_newline=own.keep_trailing_newline)
    sandboxed.filters.update(own.filters)
    utils.env = sandboxed
    try:
        yield
    finally:
        utils.env = own


def run_tasks(job, tasks: List[str], step: int, trackers=None) -> Dict[str, Dict[str, float]]:
    """lm-eval's `tasks` on the job's model (framework/job.py) (every rank); rank 0 prints, writes and logs."""
    e = job.cfg.evaluate
    lm_eval, _ = _lm_eval()
    from lm_eval.tasks import TaskManager

    if job.data.tokenizer is None:
        raise UserInputError(
            "evaluation needs a tokenizer: the data's (data=stdlib, data=hf, data.tokenizer=...) "
            "or the model directory's"
        )
    if e.include_path and not os.path.isdir(e.include_path):
        raise UserInputError(f"evaluate.include_path={e.include_path}: no such directory of task YAMLs")
    if e.include_path and not e.trust_task_code:  # checked before any rank started too (preflight.py)
        from framework.task_files import code_problem

        problem = code_problem(e.include_path, tasks)
        if problem:
            raise UserInputError(problem)
    import logging

    from jinja2.exceptions import SecurityError

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    manager = _task_manager(TaskManager, e.include_path, tasks)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UserInputError(
            f"evaluate.tasks: no lm-eval task {', '.join(unknown)}; local tasks: a YAML in "
            "evaluate.include_path (`lm-eval ls tasks` lists lm-eval's own)"
        )
    lm = make_sharded_lm(job, e.batch_size, e.max_gen_tokens)
    was_training = job.model.training
    job.model.eval()
    try:
        with _sandboxed_templates(e.trust_task_code):
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=e.num_fewshot,
                limit=e.limit,
                task_manager=manager,
                log_samples=False,
                bootstrap_iters=0,
                random_seed=job.cfg.trainer.seed,
                verbosity="ERROR",
            )
    except SecurityError as exc:
        raise UserInputError(
            f"evaluate.tasks={list(tasks)}: a task's Jinja template reached past the sandbox ({exc}); set "
            "evaluate.trust_task_code=true to render task templates unsandboxed (only for files you trust)"
        ) from None
    except (FileNotFoundError, ConnectionError, ValueError) as exc:
        raise UserInputError(
            f"evaluate.tasks={list(tasks)}: lm-eval could not run them ({type(exc).__name__}: {exc}); "
            "a task whose data is not on this machine cannot run here"
        ) from None
    finally:
        job.model.train(was_training)
    if results is None:  # lm-eval aggregates on each node's first rank only; the forwards were everyone's
        return {}
    scores = {  # "acc,none" -> "acc"; standard errors (not computed: bootstrap_iters=0) left out
        task: {k.split(",")[0]: float(v) for k, v in metrics.items() if _is_score(k, v)}
        for task, metrics in results["results"].items()
    }
    if job.rt.is_main:
        from lm_eval.utils import make_table

        print(make_table(results), file=sys.stderr, flush=True)
        from framework.fileio import create_temporary, users_directory

        out_dir = users_directory(os.path.join(job.cfg.run_dir, "eval"), "hydra.run.dir")
        path = os.path.join(out_dir, f"results_step_{step:08d}.json")

        with create_temporary(path + ".tmp") as handle:
            json.dump(
                {"step": step, "tasks": list(tasks), "results": scores, "config": results.get("config", {})},
                handle,
                indent=1,
                default=str,
            )
        os.replace(path + ".tmp", path)
        if trackers is not None:
            trackers.log(step, flat_scores(scores))
    return scores


def _is_score(key: str, value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in key


def flat_scores(scores: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    return {f"eval/{task}/{metric}": value for task, metrics in scores.items() for metric, value in metrics.items()}
