"""`ParallelDims`: the degrees of parallelism (dp_replicate, dp_shard, tp) and their arithmetic.

Context parallelism (`cp`) is a dimension of its own, between dp_shard and tp: the cp ranks of a
data-parallel rank read the same samples and each takes 1/cp of every sequence; the parameters
are sharded over dp_shard x cp ranks (the cp ranks are data-parallel ranks for the weights).

Expert parallelism (`ep`) is no dimension of its own: it splits the dp_shard ranks into groups of
`ep` neighbours that each hold every expert once (ep ranks, n_experts/ep each), and the experts
are sharded over the remaining `dp_shard / ep` ranks (`efsdp`), as torchtitan and Megatron lay it
out. Everything else stays sharded over all dp_shard ranks. Under hybrid sharding each replica
is laid out so, and the experts' gradients are averaged over the dp_replicate replicas.

Pipeline parallelism (`pp`) is the outermost dimension: pp x dp_replicate x dp_shard x cp x tp.
Each pipeline stage is a whole data-parallel (and tensor-parallel) group of its own; the stages
pass activations to their neighbours (framework/distributed/pipeline.py).

Pure arithmetic, importable without torch, so the config validation and the launcher can check a
job before any process starts. The device mesh built from these degrees lives with the process
groups (`framework.distributed.parallel_dims.build_mesh`), above the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.errors import UserInputError


def check_degrees(**degrees: int) -> None:
    """Each degree is positive, or -1 for "infer from the world size"."""
    for name, value in degrees.items():
        if value == 0 or value < -1:
            raise UserInputError(f"parallelism.{name}={value}: must be a positive degree or -1 (infer)")


@dataclass(kw_only=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1
    cp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        check_degrees(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp)
        if self.pp < 1:
            raise UserInputError(f"parallelism.pp={self.pp}: must be a positive degree (1: no pipeline)")
        unknown = [n for n in ("dp_replicate", "dp_shard", "tp") if getattr(self, n) == -1]
        if len(unknown) > 1:
            raise UserInputError(
                f"parallelism: only one of dp_replicate, dp_shard, tp may be -1 (infer), got {', '.join(unknown)}"
            )
        known = self.pp * self.dp_replicate * self.dp_shard * self.tp * self.cp * (-1 if unknown else 1)
        if unknown:
            if self.world_size % known:
                raise UserInputError(self._mismatch(f"cannot infer parallelism.{unknown[0]}"))
            setattr(self, unknown[0], self.world_size // known)
        if self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            raise UserInputError(self._mismatch("degrees do not multiply to the world size"))
        if self.ep > 1:
            self._check_ep()
        if self.pp > 1 and self.cp > 1:
            raise UserInputError(
                f"parallelism.pp={self.pp} with parallelism.cp={self.cp}: pipeline stages do not split sequences "
                "yet; set parallelism.cp=1 or parallelism.pp=1"
            )

    def _check_ep(self) -> None:
        if self.dp_shard % self.ep:
            raise UserInputError(
                f"parallelism.ep={self.ep} does not divide parallelism.dp_shard={self.dp_shard}: the experts are "
                "split over ep of the sharded data-parallel ranks; choose an ep that divides dp_shard"
            )

    def _mismatch(self, what: str) -> str:
        def show(v: int) -> str:
            return "?" if v == -1 else str(v)

        cp = f" x cp ({self.cp})" if self.cp > 1 else ""
        pp = f"pp ({self.pp}) x " if self.pp > 1 else ""
        return (
            f"parallelism: {what}: {pp}dp_replicate ({show(self.dp_replicate)}) x dp_shard "
            f"({show(self.dp_shard)}){cp} x tp ({show(self.tp)}) must equal the world size "
            f"({self.world_size}); fix parallelism.{'pp/' if self.pp > 1 else ''}dp_replicate/dp_shard/cp/tp or the "
            "number of ranks"
        )

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks that see different samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks each expert is sharded over: the dp_shard ranks holding the same experts."""
        return self.dp_shard // self.ep

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1


def resolve_parallel_dims(
    strategy: str,
    *,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    world_size: int,
    nproc_per_node: int,
    ep: int = 1,
    cp: int = 1,
    pp: int = 1,
) -> ParallelDims:
    """Fill in the degrees a strategy implies, then check them against the world size.

    full / grad_op: everything not tensor parallel is sharded (dp_replicate defaults to 1).
    no_shard: dp_shard is 1, everything is replicated (DDP-like).
    hybrid: shard within a node, replicate across nodes, unless the degrees are given.
    """
    if strategy == "no_shard":
        if dp_shard not in (-1, 1):
            raise UserInputError(
                f"parallelism.dp_shard={dp_shard} with parallelism.strategy=no_shard: "
                "no_shard replicates everything; set dp_shard=1 or choose strategy=hybrid"
            )
        dp_shard = 1
        if dp_replicate == 1 and world_size // max(tp, 1) // max(pp, 1) > 1:
            dp_replicate = -1
    elif strategy == "hybrid":
        if dp_replicate == -1 and dp_shard == -1:
            dp_shard = max(1, nproc_per_node // max(tp, 1) // max(pp, 1))
    else:
        if dp_replicate == -1 and dp_shard == -1:
            dp_replicate = 1
    if tp == -1 and (dp_replicate == -1 or dp_shard == -1):
        raise UserInputError("parallelism.tp=-1 needs dp_replicate and dp_shard given")
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world_size, ep=ep, cp=cp, pp=pp)
    if strategy == "hybrid" and dims.dp_replicate < 2:
        raise UserInputError(
            f"parallelism.strategy=hybrid needs dp_replicate > 1 (got {dims.dp_replicate}); "
            "set parallelism.dp_replicate or choose strategy=full"
        )
    return dims
