"""Every process group the framework makes takes `trainer.collective_timeout_s`, and torch is left
as it was ([Note: one timeout for every group] in framework/distributed/groups.py, [Note:
megatron alone, torch untouched] in framework/data/indexed.py): torch's module defaults and
functions are the originals (identity checks) during and after a job's run in this process."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.constants as constants
from conftest import TINY

from framework.local_ranks import run_local

c10d = dist.distributed_c10d


def _originals() -> dict:
    return {
        "default_pg_timeout": c10d.default_pg_timeout,
        "default_pg_nccl_timeout": getattr(c10d, "default_pg_nccl_timeout", None),
        "is_initialized": dist.is_initialized,
        "get_rank": dist.get_rank,
    }


def _untouched(before: dict) -> None:
    after = _originals()
    for name, value in before.items():
        assert after[name] is value, f"torch.distributed.{name} was replaced"
    assert c10d.default_pg_timeout is constants.default_pg_timeout  # torch's own 30 minutes


def _groups(rank: int, world: int) -> dict:
    """Every kind of group the framework makes, and each one's timeout; torch's defaults too."""
    from framework.distributed.fsdp.mesh import reduce_group, secondary_group
    from framework.distributed.groups import flatten, new_group, replicate_and_flat, timeout_s
    from framework.distributed.parallel_dims import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1, world_size=4), "cpu")  # 1 x 2 x 2 x 1
    flat = flatten(mesh["dp_shard", "cp"], "dp_shard_cp")
    found = {
        "world": timeout_s(None),
        "new_group": timeout_s(new_group(backend="gloo")),
        "flattened": timeout_s(flat.get_group(0)),
        "reduce_twin": timeout_s(reduce_group(flat, flat.get_group(0))),
        "hpZ": timeout_s(secondary_group(flat, 2)[0]),
        # hybrid sharding under context parallelism: (dp_replicate, dp_shard x cp)
        "replicate_and_flat": timeout_s(replicate_and_flat(mesh, "dp_replicate", ("dp_shard", "cp"), "x").get_group(1)),
    }
    for name in ("dp_shard", "cp", "tp"):
        found[f"mesh {name}"] = timeout_s(mesh[name].get_group())
    x = torch.ones(1)
    dist.all_reduce(x, group=flat.get_group(0))  # the flattened mesh's group spans its 4 ranks
    found["flat_sum"] = float(x)
    found["torch_default"] = c10d.default_pg_timeout.total_seconds()
    found["torch_default_is_torch's"] = c10d.default_pg_timeout is constants.default_pg_timeout
    return found


def test_every_group_takes_the_jobs_timeout_and_torchs_defaults_stay():
    before = _originals()
    ranks = run_local(_groups, 4, collective_timeout_s=77.0, timeout_s=240)
    for rank, found in enumerate(ranks):
        timeouts = {k: v for k, v in found.items() if not k.startswith(("flat_sum", "torch_default"))}
        assert set(timeouts.values()) == {77.0}, (rank, timeouts)
        assert found["flat_sum"] == 4.0
        assert found["torch_default"] == 1800.0 and found["torch_default_is_torch's"], rank
    _untouched(before)


def test_a_job_run_in_this_process_leaves_torch_as_it_was(tmp_path, monkeypatch):
    """A whole job in this process (one rank, megatron's builder on the stdlib data): afterwards
    torch's module attributes are the very objects they were; during megatron's build only
    megatron's modules saw a process group that is not initialised."""
    from framework.config import to_config
    from framework.config.compose import compose_config
    from framework.data import indexed
    from framework.stages import stage_of
    from framework.trainer import run

    seen = []
    real_alone = indexed.megatron_alone

    def watched():
        import contextlib

        from megatron.core.datasets import gpt_dataset

        @contextlib.contextmanager
        def inside():
            with real_alone():
                seen.append((dist.is_initialized(), gpt_dataset.torch.distributed.is_initialized(), _originals()))
                yield

        return inside()

    monkeypatch.setattr(indexed, "megatron_alone", watched)
    before = _originals()
    overrides = [o for o in TINY if not o.startswith("data=")]
    cfg = to_config(
        compose_config(
            [*overrides, "data=stdlib", f"data.cache_dir={tmp_path}/cache", "trainer.max_steps=2"]
            + ["cluster.nproc_per_node=1", "trainer.collective_timeout_s=33"]
        )
    )
    cfg.run_dir = str(tmp_path / "run")
    assert run(cfg, stage_of(cfg.stage)) == 0
    assert seen, "megatron's builder did not run"
    for torch_sees, megatron_sees, during in seen:
        assert torch_sees is True and megatron_sees is False  # only megatron was shown "alone"
        assert all(during[k] is before[k] for k in before)
    _untouched(before)
    assert datetime.timedelta(minutes=30) == c10d.default_pg_timeout
