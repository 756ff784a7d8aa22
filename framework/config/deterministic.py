"""What `trainer.deterministic=true` refuses, before any rank starts (torch-free).

The mode's promise (the same bits whatever the layout, [Note: one summation tree, whatever the
layout] in framework/distributed/fsdp/canonical.py) holds where a layout changes *where* each unit
of the global batch is computed, not *how*. Tensor and context parallelism split a unit's own
arithmetic (a matmul's inner sum, attention over a sequence) across ranks, so its bits change with
their degree; the rest below are features whose sums the mode has not been taught.
"""

from __future__ import annotations

from typing import List, Optional

from framework.config.degrees import ParallelDims
from framework.config.schema import Config, DataName, Stage


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def deterministic_problems(cfg: Config, dims: Optional[ParallelDims]) -> List[str]:
    """One line per setting that `trainer.deterministic=true` cannot keep bit for bit."""
    t, p = cfg.trainer, cfg.parallelism
    if not t.deterministic:
        return []
    head = "trainer.deterministic=true with"
    off = "(or trainer.deterministic=false)"
    errors = []
    if p.tp > 1:
        errors.append(
            f"{head} parallelism.tp={p.tp}: tensor parallelism splits each matmul's sum over ranks; "
            f"set parallelism.tp=1 {off}"
        )
    if p.cp > 1:
        errors.append(
            f"{head} parallelism.cp={p.cp}: context parallelism splits attention's sums over ranks; "
            f"set parallelism.cp=1 {off}"
        )
    if p.pp > 1:
        errors.append(
            f"{head} parallelism.pp={p.pp}: a pipeline schedule accumulates its micro-batches' gradients inside "
            f"autograd, in the schedule's order; set parallelism.pp=1 {off}"
        )
    if p.ep > 1:
        errors.append(
            f"{head} parallelism.ep={p.ep}: expert parallelism's routed sums are not in a fixed order; "
            f"set parallelism.ep=1 {off}"
        )
    if p.engine.value != "native":
        errors.append(
            f"{head} parallelism.engine={p.engine.value}: the fixed summation is our engine's; "
            "set parallelism.engine=native"
        )
    if p.quantized_comm:
        errors.append(
            f"{head} parallelism.quantized_comm=true: int8 chunks round by their layout; "
            "set parallelism.quantized_comm=false"
        )
    if cfg.stage != Stage.training:
        errors.append(f"{head} stage={cfg.stage.value}: the mode covers stage=training; drop trainer.deterministic")
    if cfg.data.name == DataName.digits:
        errors.append(
            f"{head} data=digits: its loader deals samples by rank; use data=synthetic, indexed, stdlib or hf"
        )
    if dims is None or t.micro_batch_size is None:
        return errors
    unit = t.deterministic_unit or t.micro_batch_size
    if t.micro_batch_size % unit:
        errors.append(
            f"trainer.deterministic_unit={unit} does not divide trainer.micro_batch_size={t.micro_batch_size}; "
            "give a divisor of it"
        )
    elif dims.dp > 1 and t.global_batch_size % (dims.dp * unit) == 0:
        per_rank = t.global_batch_size // (dims.dp * unit)
        if not _pow2(per_rank):
            errors.append(
                f"{head} {per_rank} units per data-parallel rank (trainer.global_batch_size={t.global_batch_size} / "
                f"dp={dims.dp} / unit={unit}): each rank's units must be a power of two to form one subtree of "
                "the sum; "
                "change trainer.global_batch_size or trainer.deterministic_unit"
            )
    if dims.dp_replicate > 1 and not _pow2(dims.dp_shard):
        errors.append(
            f"{head} parallelism.dp_shard={dims.dp_shard} and dp_replicate={dims.dp_replicate}: the shard groups "
            "must be subtrees of the sum; make dp_shard a power of two"
        )
    return errors
