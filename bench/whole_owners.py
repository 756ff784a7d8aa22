"""The figures quoted in [Note: balancing whole-matrix owners] (framework/distributed/whole_owners.py):
max/ideal Newton-Schulz work and the whole matrices' bytes per rank and step, from the planner's
arithmetic (no torch run), beside the owner rule it replaced.

    .venv/bin/python bench/whole_owners.py      # output: bench/results/whole_owners.txt
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config import compose_config, to_config  # noqa: E402
from framework.distributed.shard_layout import granule, pack  # noqa: E402
from framework.distributed.whole_owners import max_over_ideal  # noqa: E402
from framework.planner.estimate import _matrix_cost, layouts, muon_tensors, muon_work  # noqa: E402
from framework.planner.plan import job_from_config  # noqa: E402


def main() -> None:
    """Max/ideal work and the whole matrices' bytes per rank and step (the busiest), for the layouts
    quoted in [Note: balancing whole-matrix owners], beside the rule it replaced (a matrix inside a
    rank's shard that rank's, the crossing ones of each unit round-robin; the unit's flat fp32
    shard gathered and reduce-scattered where one crossed: (N-1) S x 4 bytes received and as many
    sent); now what the two all-to-alls send and receive (as many each way)."""
    print("model        ranks boundary   max/ideal before  after   MiB sent + received per rank, step: before    after")
    for model, ranks in (("debug", 2), ("debug", 4), ("llama3_1_8b", 8), ("llama3_1_8b", 64)):
        for boundary in ("anywhere", "rows", "params"):
            overrides = [f"model={model}", "optimizer=muon", f"cluster.nproc_per_node={ranks}"]
            overrides += [f"parallelism.shard_boundary={boundary}", "trainer.micro_batch_size=1"]
            job = job_from_config(to_config(compose_config(overrides + [f"trainer.global_batch_size={ranks}"])))
            w = muon_work(job)
            old, old_bytes = [0] * ranks, 0
            for lay in layouts(job):
                offsets, S = pack([(t.numel, granule(t.numel, t.row, boundary)) for t in lay.unit.tensors], ranks)
                crossing = 0
                for o, t, h in zip(offsets, lay.unit.tensors, muon_tensors(lay)):
                    if h and t.numel:
                        first, last = o // S, (o + t.numel - 1) // S
                        old[first if first == last else crossing % ranks] += _matrix_cost(t, 1)
                        crossing += first != last
                old_bytes += 2 * (ranks - 1) * S * 4 if crossing else 0
            print(
                f"{model:12} {ranks:5} {boundary:9} {max_over_ideal(old):10.3f} {w.max_over_ideal:6.3f} "
                f"{old_bytes / 2**20:43.1f} {2 * max(w.bytes_sent) / 2**20:8.1f}"
            )


if __name__ == "__main__":
    main()
