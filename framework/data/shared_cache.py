"""Whether every rank sees the same `data.cache_dir`, and so who prepares what goes there.

[Note: a cache per node or one for the job]
`data.cache_dir` defaults to `data_cache` under the working directory, which in containers
(`--container-workdir`) and on Kubernetes is each node's own. A corpus prepared by global rank 0
only would then be missing on every other node. So the job asks once, collectively: rank 0
writes a marker file with a fresh token into the cache directory, and every rank looks for it.
Seen by all: one cache for the job, prepared by rank 0 while the others wait. Not seen by some:
a cache per node, prepared by each node's local rank 0; megatron-core writes its shuffled index
files from global rank 0 only, so each node's local rank 0 first runs megatron's builder as if it
were alone (`framework/data/indexed._build_in_turn`) and every rank then finds them in its
node's cache. Either way a two-node job on default settings trains; the log says which it is.
"""

from __future__ import annotations

import os
import sys


def cache_is_shared(cache_dir: str) -> bool:
    """Collective over the default group: does every rank see `cache_dir` as the same directory?"""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    os.makedirs(cache_dir, exist_ok=True)
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = os.path.join(cache_dir, f".shared-{token[0]}")
    if dist.get_rank() == 0:
        with open(marker, "w") as f:
            f.write("a job checks whether every node sees this directory; deleted at once\n")
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.exists(marker))
    if dist.get_rank() == 0:
        os.remove(marker)
        if not all(seen):
            print(
                f"data.cache_dir={cache_dir} is not shared by every node: each node prepares its own copy "
                "(give a shared path to prepare once)",
                file=sys.stderr,
                flush=True,
            )
    return all(seen)


def prepares_here(shared: bool) -> bool:
    """Does this rank prepare the cache: global rank 0 of a shared one, local rank 0 of each node's."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    if shared:
        return dist.get_rank() == 0
    return int(os.environ.get("LOCAL_RANK", "0")) == 0
