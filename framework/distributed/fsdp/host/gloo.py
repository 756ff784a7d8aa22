"""gloo's TCP for a CPU process group, with the two bulk collectives built to work in place.

[Note: gloo collectives built from in-place primitives]
On gloo, `all_gather_single` gathers into a temporary and copies every chunk out, and
`reduce_scatter_single` clones the whole input, all-reduces it (twice the reduce-scatter traffic)
and copies the chunk out: two full-size copies and a full-size allocation per call (seen in the
profiler as aten::copy_ of unit size). So here the all-gather is one broadcast per rank straight
into its slice of the output (only this rank's own shard is copied in), and the reduce-scatter is
an all-to-all that sends every other rank its chunk and receives theirs, summed locally into the
output (traffic (N-1) x shard, as the theory says). Both still count as ONE collective in the
engine's counters (logical ops). With more than two ranks, a rank whose own chunk is not at an
end of the buffer receives every chunk, so the reduce-scatter needs receive scratch
(`scratch_numel`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..transport import Transport


class GlooTransport(Transport):
    name = "gloo"

    def scratch_numel(self, shard_numel: int) -> int:
        n, r = self.world, self.rank
        if n <= 2:
            return 0  # two ranks receive straight into the output
        return (n - 1) * shard_numel if r in (0, n - 1) else n * shard_numel

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor):
        n, r, S = self.world, self.rank, shard.numel()
        own = output[r * S : (r + 1) * S]
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        return [
            dist.broadcast(output[j * S : (j + 1) * S], group=self.group, group_src=j, async_op=True) for j in range(n)
        ]

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, scratch: Optional[torch.Tensor]):
        n, r, S = self.world, self.rank, output.numel()
        own = full[r * S : (r + 1) * S]
        if r in (0, n - 1):  # own chunk at one end: exchange only the other chunks
            send = full[S:] if r == 0 else full[: (n - 1) * S]
            splits = [0 if j == r else S for j in range(n)]
            recv = output if n == 2 else scratch[: (n - 1) * S]
            work = dist.all_to_all_single(recv, send, splits, splits, group=self.group, async_op=True)

            def finish() -> None:
                if n == 2:
                    output.add_(own)
                    return
                parts = recv.view(n - 1, S)
                torch.add(own, parts[0], out=output)
                for k in range(1, n - 1):
                    output.add_(parts[k])

        else:
            recv = scratch[: n * S]
            work = dist.all_to_all_single(recv, full, group=self.group, async_op=True)

            def finish() -> None:
                torch.sum(recv.view(n, S), dim=0, out=output)

        return work, finish
