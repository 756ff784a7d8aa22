"""Per-rank runs for tests/tp/test_combinations.py: LoRA and float8 composed with tensor parallel
(and sharding), each against one process on the same global batches.

No tests in here. A `Case` names a layout and the features on it; `rank_main` runs several cases
in one spawn (tests/distributed/harness.py) and returns, from rank 0, each step's loss and
gradient norm and the final parameters gathered whole; `reference` is the one-process run of the
same features. The model is tests/tp/tp_cases.py's debug Llama, whose linears (64 -> 64,
64 -> 176, 176 -> 64; kv 64 -> 32) are all float8-convertible (multiples of 16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.distributed as dist

from framework.config.schema import Engine, ParallelismConfig, Strategy
from framework.distributed.engines import engine_of
from framework.distributed.parallel_dims import ParallelDims, build_mesh
from framework.distributed.parallelize import parallelize
from framework.distributed.tensor_parallel import full, loss_context
from framework.models.llama import FAMILY as LLAMA
from framework.models.llama import build_llama
from framework.models.tasks import cross_entropy as loss_fn
from tests.tp.tp_cases import GLOBAL_BATCH, SEED, batches, model_cfg

STEPS = 5
LR, MOMENTUM, MAX_NORM = 0.5, 0.9, 1.0
VOCAB = 256
LORA = dict(rank=4, alpha=8.0, targets=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])


@dataclass(frozen=True)
class Case:
    dp_shard: int
    tp: int
    sequence_parallel: bool = False
    engine: str = "native"
    lora: bool = False
    float8: bool = False
    float8_recipe: str = "tensorwise"

    @property
    def name(self) -> str:
        feats = [f for f, on in (("lora", self.lora), (f"f8{self.float8_recipe}", self.float8)) if on]
        sp = "-sp" if self.sequence_parallel else ""
        return f"{'+'.join(feats)}-dp{self.dp_shard}xtp{self.tp}{sp}-{self.engine}"


def _model(case: Case):
    torch.manual_seed(SEED)
    model = build_llama(model_cfg(VOCAB))
    model.init_weights(seed=SEED)
    if case.lora:
        from framework.peft.lora import apply_lora

        apply_lora(model, seed=SEED, **LORA)
    return model


def _parallelism(case: Case) -> ParallelismConfig:
    return ParallelismConfig(
        engine=Engine(case.engine),
        strategy=Strategy.full,
        dp_shard=case.dp_shard,
        tp=case.tp,
        sequence_parallel=case.sequence_parallel,
        float8=case.float8,
        float8_recipe=case.float8_recipe,
    )


def _trained(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def reference(case: Case) -> dict:
    """One process, the case's features (LoRA, float8 on CPU emulation), plain torch. With float8
    the global batch runs as `dp_shard` accumulated micro-batches, the rows each dp rank holds:
    an activation's float8 scale is its absmax over the rows a forward sees, so a dp rank's
    scales are those of its micro-batch (the weights' scales are whole-tensor either way)."""
    model = _model(case)
    if case.float8:
        from framework.distributed.float8 import apply_float8

        apply_float8(model, _parallelism(case), "cpu", torchao_gathers=False)
    opt = torch.optim.SGD(_trained(model), lr=LR, momentum=MOMENTUM)
    losses, norms = [], []
    micro = case.dp_shard if case.float8 else 1
    for inputs, labels in batches(VOCAB)[:STEPS]:
        loss = sum(loss_fn(model(x), y) for x, y in zip(inputs.chunk(micro), labels.chunk(micro))) / micro
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(_trained(model), MAX_NORM).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params}


def run_case(case: Case, world: int) -> dict:
    cfg = _parallelism(case)
    dims = ParallelDims(dp_replicate=1, dp_shard=case.dp_shard, tp=case.tp, world_size=world)
    mesh = build_mesh(dims, "cpu")
    model = parallelize(_model(case), dims, mesh, cfg, LLAMA)
    opt = torch.optim.SGD(_trained(model), lr=LR, momentum=MOMENTUM)
    dp_rank, per_rank = mesh["dp_shard"].get_local_rank(), GLOBAL_BATCH // case.dp_shard
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    losses, norms = [], []
    for inputs, labels in batches(VOCAB)[:STEPS]:
        with loss_context(model):
            loss = loss_fn(model(inputs[rows]), labels[rows])
            loss.backward()
        value = full(loss.detach()).clone()
        dist.all_reduce(value, group=mesh["dp_shard"].get_group())
        losses.append(value.item() / case.dp_shard)
        norms.append(full(engine_of(cfg.engine).clip_grad_norm(model, MAX_NORM)).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    # numpy: tensors through torch's multiprocessing queue would live in the exiting rank's memory
    params = {k: full(v).detach().numpy().copy() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params if dist.get_rank() == 0 else None}


def rank_main(rank: int, world: int, cases: List[Case]) -> Dict[str, dict]:
    out = {}
    for case in cases:
        out[case.name] = run_case(case, world)
        dist.barrier()
    return out
