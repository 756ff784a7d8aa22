"""Pipeline jobs through the launcher: the mesh derived from the cluster shape gives the pipeline
stages whole nodes, and a pp that does not divide the nodes is refused in one line. The rendered
script of a pp job is the golden case `slurm_pp` (tests/launcher/test_launcher_render.py)."""

from __future__ import annotations

import pytest
from launcher_testlib import plan_of

from launcher_scripts.plan import Refused

JOB = [
    "cluster=slurm",
    "cluster.gpus_per_node=8",
    "model=llama_7b",
    "parallelism.tp=2",
    "cluster.derive_mesh=true",
    "data=synthetic",
    "data.seq_len=128",
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=64",
]


def test_derived_mesh_gives_the_stages_whole_nodes():
    p = plan_of(JOB + ["cluster.nodes=4", "parallelism.pp=2"])
    par = p.cfg.parallelism
    assert (par.pp, par.dp_replicate, par.dp_shard, par.tp) == (2, 2, 4, 2)  # 2 x 2 x 4 x 2 = 32 ranks
    assert "parallelism.dp_replicate=2" in p.overrides and "parallelism.dp_shard=4" in p.overrides


def test_a_pp_that_does_not_divide_the_nodes_is_refused():
    with pytest.raises(Refused) as refused:
        plan_of(JOB + ["cluster.nodes=3", "parallelism.pp=2"])
    assert refused.value.problems == [
        "cluster.derive_mesh: parallelism.pp=2 does not divide cluster.nodes=3; the stages are whole nodes' "
        "worth of ranks: choose a pp that divides the nodes"
    ]
