"""A hung rank on NCCL: what a CUDA rank sets before its process group is made, so that a timed-out
collective reaches the diagnosis ([Note: a hung rank on NCCL] in framework/runtime.py).

No GPU runs here: these check the environment and the timeout each rank gives torch, with the
process group's creation replaced by a recorder (what torch then does with them is torch's)."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from framework import runtime

NCCL_KEYS = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")


@pytest.fixture
def joined(monkeypatch):
    """`join(device, timeout_s, **env)`: runs init_distributed for one rank on `device` with `env`
    exported, and returns what init_process_group was given: backend, timeout, the TORCH_NCCL_*
    variables in the environment at that moment."""

    def join(device: str, timeout_s: float, **env: str) -> dict:
        seen: dict = {}
        for key in NCCL_KEYS:
            monkeypatch.delenv(key, raising=False)  # restored after the test, whatever the rank sets
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setattr(runtime, "pick_device", lambda requested, local_rank: torch.device(device))
        monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
        monkeypatch.setattr(runtime, "_job_store", lambda rank, world, timeout: None)

        def init_process_group(backend, **kwargs):
            seen.update(backend=backend, timeout=kwargs["timeout"], env={k: os.environ.get(k) for k in NCCL_KEYS})

        monkeypatch.setattr(runtime.dist, "init_process_group", init_process_group)
        runtime.init_distributed(device, collective_timeout_s=timeout_s)
        return seen

    return join


def test_cuda_ranks_wait_blocking_with_the_jobs_timeout(joined):
    seen = joined("cuda", 42.0)
    # Blocking wait: a collective that waits longer than the timeout raises in the rank's own thread
    # (report_crash then names the missing rank); torch's default would abort the process from its
    # watchdog thread instead. Torch's own monitor keeps its default (8 minutes), far past our 4 s.
    assert seen["backend"] == "cpu:gloo,cuda:nccl"
    assert seen["env"] == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": None}
    assert seen["timeout"] == datetime.timedelta(seconds=42)


def test_a_short_nccl_monitor_is_raised_past_the_diagnosis(joined):
    seen = joined("cuda", 300.0, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="10")
    assert seen["env"] == {
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(runtime.NCCL_MONITOR_FLOOR_S),
    }
    assert runtime.NCCL_MONITOR_FLOOR_S > 4 * runtime.HEARTBEAT_S  # the diagnosis reads 4 heartbeats
    assert joined("cuda", 300.0, TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="900")["env"]["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == (
        "900"
    )


def test_an_exported_blocking_wait_0_is_kept_and_cpu_ranks_set_nothing(joined):
    # The user's explicit choice: torch's watchdog then ends a hung job (docs/reliability.md).
    assert joined("cuda", 300.0, TORCH_NCCL_BLOCKING_WAIT="0")["env"] == {
        "TORCH_NCCL_BLOCKING_WAIT": "0",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": None,
    }
    cpu = joined("cpu", 300.0)
    assert cpu["backend"] == "gloo" and cpu["env"] == dict.fromkeys(NCCL_KEYS)
