"""Process-group setup, and starting local ranks when `main.py` is not under torchrun."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(requested_device: str) -> Runtime:
    """Join the process group described by torchrun's environment (a world of 1 without it)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = pick_device(requested_device, local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world,
                                device_id=device if device.type == "cuda" else None)
    return Runtime(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ


def _local_rank_entry(local_rank: int, fn: Callable[[Any], int], arg: Any, nprocs: int, port: int) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # As torchrun does: one compute thread per rank unless the user says otherwise, so the ranks
    # (and the communication threads) do not oversubscribe the cores.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    code = fn(arg)
    if code:
        raise SystemExit(code)


def spawn_local(fn: Callable[[Any], int], arg: Any, nprocs: int) -> int:
    """Run `fn(arg)` on `nprocs` local ranks; return the first non-zero exit status (0 if none).

    SIGTERM and SIGUSR1 sent to this process (a scheduler's pre-emption notice, `kill`) are passed
    on to every rank, which save a checkpoint and exit with the requeue status. When one rank
    fails, the others get a few seconds to notice and exit before they are stopped.
    """
    import signal

    import torch.multiprocessing as mp

    ctx = mp.start_processes(_local_rank_entry, args=(fn, arg, nprocs, free_port()), nprocs=nprocs,
                             join=False, start_method="spawn")

    def forward(signum, _frame):
        for process in ctx.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    status = 0
    try:
        while not ctx.join(grace_period=5):
            pass
    except mp.ProcessExitedException as exc:
        status = exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1
    except mp.ProcessRaisedException:
        status = 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
