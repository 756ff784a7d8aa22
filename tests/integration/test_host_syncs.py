"""The training step makes the host wait for the device on log steps only ([Note: the host reads
the device on log steps only] in framework/metrics.py), and a non-finite loss still stops the
job, at the next log step at the latest, naming the step where it happened."""

import collections
import math
import sys

import torch
from conftest import REPO, TINY, read_metrics, run_main

from framework.distributed.fsdp.collectives import CommStats
from framework.errors import EXIT_DIVERGED
from framework.stop import StopPolicy

# What makes a host wait for a GPU when the value read lives there: reading a tensor's value, and
# CUDA's explicit waits. `CommStats.resolve` is one too: on CUDA it synchronizes on the timed
# waits' events (see collectives.wait); on a CPU run its events are empty, so it is counted by name.
_TENSOR_READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist", "numpy")

# Reads of host memory in every run, whatever the device, left out of the count: the data loader
# builds its batches on the host (framework/data/); the host transport moves CPU tensors only
# (framework/distributed/fsdp/host/); the stop check exchanges host flags (framework/stop.py, which
# test_the_stop_check_never_touches_the_device holds to the host).
_HOST_ONLY = ("framework/data/", "framework/distributed/fsdp/host/", "framework/stop.py")


def _count_reads(rank, world, run_dir, overrides):
    """Train with every device read of our own code counted per step: {step: ["file:line", ...]}.
    Only reads whose caller is in framework/ count; torch's own are torch's (its optimizers read
    their step counters, which live on the host unless `capturable`)."""
    from framework.config import compose_config, to_config
    from framework.runtime import Runtime
    from framework.stages import stage_of
    from framework.trainer import build_trainer

    cfg = to_config(compose_config(TINY + overrides))
    cfg.run_dir = run_dir
    trainer = build_trainer(cfg, Runtime(rank, world, rank, torch.device("cpu")), stage_of(cfg.stage))
    reads = collections.defaultdict(list)
    starting = [False]  # from the step's first act (resetting the counters) to the end of train_step

    def where_and_when(frame):
        path = frame.f_code.co_filename
        ours = path.startswith(str(REPO / "framework")) and not any(str(REPO / h) in path for h in _HOST_ONLY)
        if ours:  # up to the end of train_step a read belongs to the step running; after, to the one done
            step = trainer.state.step + (1 if starting[0] else 0)
            reads[step].append(f"{path[len(str(REPO)) + 1 :]}:{frame.f_lineno}")

    def counted(original):
        def wrapper(*args, **kwargs):
            where_and_when(sys._getframe(1))
            return original(*args, **kwargs)

        return wrapper

    for name in _TENSOR_READS:
        setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    torch.cuda.synchronize = counted(torch.cuda.synchronize)
    torch.cuda.Event.synchronize = counted(torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = counted(torch.cuda.Stream.synchronize)
    CommStats.resolve = counted(CommStats.resolve)

    step, reset = trainer.train_step, trainer.engine.reset_counters

    def reset_counters(*args, **kwargs):
        starting[0] = True
        return reset(*args, **kwargs)

    def train_step(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        finally:
            starting[0] = False

    trainer.train_step, trainer.engine.reset_counters = train_step, reset_counters
    trainer.fit()
    return dict(reads)


def test_the_step_reads_the_device_on_log_steps_only(tmp_path):
    from tests.distributed.harness import run_ranks

    overrides = ["trainer.max_steps=6", "trainer.log_interval=3", "trainer.eval_interval=0", "logging.jsonl=true"]
    for rank, reads in enumerate(run_ranks(_count_reads, world_size=2, args=(str(tmp_path), overrides))):
        assert {s: r for s, r in reads.items() if s % 3} == {}, (rank, reads)  # steps 1, 2, 4, 5
        assert reads.get(3) and reads.get(6), (rank, reads)  # the log steps read the loss
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [3, 6]
    for record in records:  # what the log steps read: the step's own numbers, all finite
        assert all(math.isfinite(record[k]) and record[k] > 0 for k in ("loss", "grad_norm", "step_time_s")), record
        assert record["comm_bytes"] > 0, record


def test_the_stop_check_never_touches_the_device():
    """The stop flags are host values (exchanged over the host half of the process group on a GPU
    run): on the meta device, where a tensor has no value to read, the check still answers."""
    policy = StopPolicy(max_time_minutes=0, rank=0, device=torch.device("meta"))
    try:
        assert policy.should_stop(1) is False
        policy.signal_name = "SIGTERM"
        assert policy.should_stop(2) is True and policy.reason == "signal SIGTERM"
    finally:
        policy.close()


class _Event:
    """A CUDA event's timing side: the milliseconds since `before`, and whether it was waited on."""

    def __init__(self, ms=0.0):
        self.ms, self.waited, self.done = ms, 0, True

    def synchronize(self):
        self.waited += 1

    def query(self):
        return self.done

    def elapsed_time(self, after):
        return after.ms - self.ms


def test_resetting_the_counters_does_not_wait_for_the_device():
    """Every step starts by resetting the engine's counters: that must not wait on the timed
    waits' events (it used to, only to throw their times away); reading them does."""
    stats = CommStats()
    pairs = [(_Event(0.0), _Event(2.0)), (_Event(5.0), _Event(8.0))]
    stats._events.extend(pairs)
    stats.reset()
    assert [after.waited for _, after in pairs] == [0, 0] and stats.exposed_comm_s == 0.0
    assert stats._events == []
    stats._events.extend(pairs)
    stats.resolve()
    assert [after.waited for _, after in pairs] == [1, 1] and stats.exposed_comm_s == 0.005


def test_a_nan_loss_between_log_steps_stops_at_the_next_and_names_its_step(tmp_path):
    """The loss goes NaN at step 3 (test_nan_loss_stops_and_names_the_step's recipe); read every 4
    steps, it is found at step 4: exit 3, the message names step 3, and the only checkpoint is
    step 2's (each save reads the loss first)."""
    run = tmp_path / "run"
    out = run_main(
        TINY
        + [
            "parallelism.engine=torch",
            "optimizer=sgd",
            "optimizer.lr=1e12",
            "optimizer.clip_grad_norm=0",
            "trainer.max_steps=8",
            "trainer.log_interval=4",
            "checkpoint.interval=2",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert out.returncode == EXIT_DIVERGED, out.stderr[-3000:]
    errors = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("error:")]
    assert errors == [
        "error: loss is nan at step 3, found at step 4 (the loss is read on log steps, every "
        "trainer.log_interval=4 steps, and before evaluations and checkpoints); stopping with no checkpoint after "
        "step 2. Lower optimizer.lr or enable optimizer.clip_grad_norm"
    ], out.stdout + out.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists() or read_metrics(run) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_00000002"]


def test_a_batch_goes_to_the_gpu_without_the_host_waiting(monkeypatch):
    """A copy from pageable host memory to a GPU makes the host wait for the device (torch
    synchronizes the stream after it); from pinned memory with non_blocking it does not. This
    machine has no GPU, so the tensor's own copy methods are stood in for, recording each call."""
    from framework.models.tasks import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append(("pin", t.shape)) or t)
    host_to = torch.Tensor.to

    def to(t, *args, **kwargs):
        device = torch.device(args[0] if args else kwargs["device"])
        if device.type != "cuda":
            return host_to(t, *args, **kwargs)
        calls.append(("to", t.shape, kwargs.get("non_blocking", False)))
        return t

    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = (torch.zeros(2, 3, dtype=torch.long), {"labels": torch.ones(2, dtype=torch.long)})
    to_device(batch, torch.device("cuda", 0))
    assert calls == [("pin", (2, 3)), ("to", (2, 3), True), ("pin", (2,)), ("to", (2,), True)]
    calls.clear()
    to_device(batch, torch.device("cpu"))  # on a CPU run nothing is pinned or copied
    assert calls == []
