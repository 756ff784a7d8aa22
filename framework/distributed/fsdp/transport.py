"""How one process group moves the engine's all-gathers and reduce-scatters.

[Note: one transport per group]
The engine's two bulk collectives, "gather equal shards into this buffer" and "sum-scatter this
buffer into a shard", go through a `Transport` object. One is chosen per (process group, device
type) the first time a unit needs it (at the model's lazy init, on every rank in the same order),
by `collectives.transport_for`, and kept for the life of the group: every rank of a group uses the
same one, and nothing on the hot path asks which it is. The default moves them with
torch.distributed's single-tensor collectives, which is what NCCL (and any accelerator backend)
does best. CPU process groups may have a host transport instead (`framework/distributed/fsdp/host/`).
Buffers are flat and rank-major: `output` of an all-gather is N x shard, `full` of a
reduce-scatter is N x shard and `output` one shard.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .tree import tree_sum

Finish = Optional[Callable[[], None]]  # local work after the wait (e.g. summing received chunks)


class Transport:
    """The all-gather and reduce-scatter of one process group (see [Note: one transport per group])."""

    name = "torch"

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def scratch_numel(self, shard_numel: int) -> int:
        """Elements of receive scratch `reduce_scatter` needs for a shard of `shard_numel` (0 = none).
        A property of the transport, fixed when it is chosen: buffer sizing never asks the group."""
        return 0

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> Any:
        """Issue the gather of every rank's `shard` into `output`; returns a handle with `wait()`."""
        return _all_gather_single(output, shard, group=self.group, async_op=True)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, scratch: Optional[torch.Tensor]
    ) -> Tuple[Any, Finish]:
        """Issue the sum over ranks of `full`, keeping this rank's chunk in `output`; `full` and
        `scratch` stay untouched until the wait (and `finish`) are done."""
        work = _reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return work, None

    def tree_reduce_scatter(self, output: torch.Tensor, full: torch.Tensor) -> Tuple[Any, Finish]:
        """Issue the sum over ranks of `full` into this rank's chunk `output`, the N ranks' chunks
        added in the canonical tree's order (`canonical.tree_sum`, rank i is leaf i): the
        deterministic mode's reduction, whose bits depend on the data only ([Note: one summation
        tree, whatever the layout] in canonical.py). Here an all-to-all (a reduce-scatter's bytes)
        into a receive buffer, summed at the finish; `full` stays untouched until then."""
        n, S = self.world, output.numel()
        recv = torch.empty_like(full)
        work = dist.all_to_all_single(recv, full, group=self.group, async_op=True)

        def finish() -> None:
            tree_sum(list(recv.view(n, S).unbind()), out=output)

        return work, finish

    def close(self) -> None:
        """Let go of what the transport holds (called when its group goes away)."""


# The single-tensor collectives under their current names, or their older ones on a torch before
# them. Looked up at each call, so a wrapper installed on `torch.distributed` (bench/simulate.py's
# recorder, a profiler) sees them.
def _all_gather_single(*args, **kwargs):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def _reduce_scatter_single(*args, **kwargs):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)
