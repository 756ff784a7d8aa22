"""Per-rank training runs for the tensor-parallel tests, and their single-process reference.

No tests in here: `test_tp_training.py` spawns gloo ranks (tests/distributed/harness.py) that run
`rank_main`, several layouts per spawn, and compares what rank 0 returns with `reference()`.

Every run starts from the same weights (the debug Llama, `init_weights(seed=SEED)`) and sees the
same global batches; a data-parallel rank takes its contiguous slice of each global batch, so
the mean of the dp ranks' losses is the reference's loss on the whole batch. SGD with momentum
(not Adam, whose normalisation would hide a gradient scaled by t or dp), gradient clipping on.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from framework.config.schema import Engine, ModelConfig, ParallelismConfig, Strategy
from framework.distributed.engines import engine_of
from framework.distributed.parallel_dims import ParallelDims, build_mesh
from framework.distributed.parallelize import parallelize
from framework.distributed.tensor_parallel import full, loss_context
from framework.models.llama import FAMILY as LLAMA
from framework.models.llama import build_llama
from framework.models.tasks import cross_entropy as loss_fn

SEED = 1234
STEPS = 10
GLOBAL_BATCH = 4
SEQ = 16  # divisible by tp (sequence parallel shards it)
LR, MOMENTUM, MAX_NORM = 0.5, 0.9, 1.0  # large lr: 10 steps move the weights visibly
MODEL = ModelConfig(
    name="debug",
    args=dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, max_seq_len=SEQ),
)


@dataclass(frozen=True)
class Layout:
    dp_shard: int
    tp: int
    sequence_parallel: bool = False
    engine: str = "torch"
    vocab: int = MODEL.args["vocab_size"]  # 255: uneven vocabulary shards at tp=2
    tie: bool = False  # output head tied to the embedding table
    dp_replicate: int = 1  # > 1: hybrid sharding (replicate x shard) composed with tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        sp = "-sp" if self.sequence_parallel else ""
        vocab = "" if self.vocab == MODEL.args["vocab_size"] else f"-vocab{self.vocab}"
        tie = "-tied" if self.tie else ""
        rep = f"rep{self.dp_replicate}x" if self.dp_replicate > 1 else ""
        return f"{rep}dp{self.dp_shard}xtp{self.tp}{sp}-{self.engine}{vocab}{tie}"


@dataclass(frozen=True)
class Job:
    """Train `layout` from `first_step` to `STEPS`; load the checkpoint `load` first (if given),
    save one to `save` after `save_at` steps (if given)."""

    layout: Layout
    first_step: int = 0
    load: Optional[str] = None
    save: Optional[str] = None
    save_at: int = 0


def model_cfg(vocab: int, tie: bool = False) -> ModelConfig:
    return dataclasses.replace(MODEL, args={**MODEL.args, "vocab_size": vocab, "tie_embeddings": tie})


def batches(vocab: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(SEED + 1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(vocab, (GLOBAL_BATCH, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference(vocab: int = MODEL.args["vocab_size"], tie: bool = False) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """Losses of each step, the final parameters and (key "logits") the final model's logits on
    the first batch, of a plain single-process run."""
    torch.manual_seed(SEED)
    model = build_llama(model_cfg(vocab, tie))
    model.init_weights(seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for inputs, labels in batches(vocab):
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        final["logits"] = model.eval()(batches(vocab)[0][0])
    return losses, final


class EngineRefused(Exception):
    """An engine declined the layout with NotImplementedError (a composition it does not support):
    a failure of that layout's test (tests/tp/test_tp_training.py's `_check`), since every layout
    listed there is one both engines support."""


def _build(layout: Layout, world: int):
    dims = ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp, world_size=world)
    mesh = build_mesh(dims, "cpu")
    torch.manual_seed(SEED)
    model = build_llama(model_cfg(layout.vocab, layout.tie))
    model.init_weights(seed=SEED)
    strategy = Strategy.hybrid if layout.dp_replicate > 1 else Strategy.full
    cfg = ParallelismConfig(
        engine=Engine(layout.engine),
        strategy=strategy,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
    )
    try:
        model = parallelize(model, dims, mesh, cfg, LLAMA)
    except NotImplementedError as exc:
        raise EngineRefused(f"the {layout.engine} engine refused {layout.name}: {exc}") from exc
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    return model, opt, mesh, cfg


def _state_dicts(model, opt, engine: str):
    return engine_of(engine).get_state_dicts(model, opt)


def _set_state_dicts(model, opt, engine: str, model_sd, optim_sd) -> None:
    engine_of(engine).set_state_dicts(model, opt, model_sd, optim_sd)


def _save(model, opt, engine: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = _state_dicts(model, opt, engine)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _load(model, opt, engine: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    # The target layout's own state dicts say which piece of each tensor this rank wants; DCP
    # reads exactly that out of the files written by another layout.
    model_sd, optim_sd = _state_dicts(model, opt, engine)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    _set_state_dicts(model, opt, engine, state["model"], state["optim"])


def run_job(job: Job, world: int) -> dict:
    """One layout's run on this rank: the dp-mean loss of each step and (rank 0) full parameters."""
    layout = job.layout
    model, opt, mesh, cfg = _build(layout, world)
    if job.load:
        _load(model, opt, layout.engine, job.load)
    # A data-parallel rank's index over (dp_replicate, dp_shard), replicate-major like the trainer's.
    dp_groups = [mesh["dp_shard"].get_group()]
    if layout.dp_replicate > 1:
        dp_groups.append(mesh["dp_replicate"].get_group())
    dp_rank = mesh["dp_replicate"].get_local_rank() * layout.dp_shard + mesh["dp_shard"].get_local_rank()
    per_rank = GLOBAL_BATCH // layout.dp
    losses = []
    for step, (inputs, labels) in enumerate(batches(layout.vocab)[job.first_step :], start=job.first_step):
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        with loss_context(model):
            loss = loss_fn(model(inputs[rows]), labels[rows])
            loss.backward()
        value = full(loss.detach()).clone()
        for group in dp_groups:
            dist.all_reduce(value, group=group)
        losses.append(value.item() / layout.dp)
        engine_of(cfg.engine).clip_grad_norm(model, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if job.save and step + 1 == job.save_at:
            _save(model, opt, layout.engine, job.save)
    # numpy, not tensors: torch's multiprocessing queue shares tensors through shared memory that
    # the exiting rank would take with it.
    params = {k: full(v).detach().numpy().copy() for k, v in model.state_dict().items()}
    with torch.no_grad():  # whole-vocabulary logits, as sampling and evaluation tools see them
        params["logits"] = full(model.eval()(batches(layout.vocab)[0][0])).numpy().copy()
    return {"losses": losses, "params": params if dist.get_rank() == 0 else None}


def rank_main(rank: int, world: int, jobs: List[Job]) -> Dict[str, dict]:
    """Every job in turn on this rank (one spawn, many layouts). A job whose engine refuses it
    (NotImplementedError: a tensor-parallel composition it lacks) reports the engine's message
    instead of results, and the other jobs still run."""
    out = {}
    for job in jobs:
        key = job_key(job)
        try:
            out[key] = run_job(job, world)
        except EngineRefused as exc:
            out[key] = {"refused": str(exc)}
        dist.barrier()
    return out


def job_key(job: Job) -> str:
    source = f"<-{os.path.basename(job.load)}" if job.load else ""
    return job.layout.name + source
