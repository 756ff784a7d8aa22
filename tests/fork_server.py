"""The tests' one fork server: every gloo rank and every `python main.py` job of a test process is
forked from it.

[Note: the tests' fork server]
Most end-to-end tests run `python main.py ...` as a user would, a few hundred times in the suite,
and most distributed tests start gloo ranks, a few hundred groups; each process started afresh
spent ~4 s importing torch, Hydra and the framework before its own work, most of a tiny job's wall
time. A test process starts one multiprocessing fork server (`context()`), which imports them once
(`PRELOAD`, with what many jobs' ranks would import again: megatron.core for the indexed data,
transformers for model=hf), and forks from there:
- the ranks of `tests/distributed/harness.py:run_ranks`, started as every rank of the framework is
  (framework/local_ranks.py's `run_local`, start="forkserver"), never from the test process itself
  (which ran autograd and opened process groups);
- the `python main.py` jobs of `tests/conftest.py:run_main` and `start_main` (`main_job`): the
  child takes the request's working directory, environment and argv, sends its stdout/stderr to
  files, and runs main.py as `__main__` (`runpy.run_path`): the same code path as the command line,
  from a process whose only history is those imports (no thread started, no torch op run). The job
  starts its own ranks as a user's does (framework/local_ranks.py's `spawn_local`). conftest uses it
  when the environment asks for nothing the interpreter reads at start (its PYTHONPATH is the
  repository's, possibly after folders holding a `sitecustomize.py`, which the child imports as
  `site` would); otherwise a real subprocess. A job under torchrun is a real subprocess
  (conftest's `torchrun`).
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys

MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "main.py")

# Imported once by the fork server, so each rank and job starts with them.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # ~1.7 s: the engine's hooks import it (torch.compiler.disable), so does a meta fill
    "hydra",
    "framework.data.indexed",  # megatron.core, ~2.8 s: every job on the stdlib or indexed data
    "framework.distributed",
    "framework.distributed.fsdp",
    "framework.models",
    "framework.trainer",
    "framework.entrypoint",
    "framework.local_ranks",
    # transformers and the modules a model=hf job reaches (~2.5 s of every such job's ranks on two
    # cores: its model classes and their torchao/accelerate checks load on first use)
    "transformers",
    "transformers.activations",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "tests.fork_server",
]


def context():
    """This test process's fork server, started on first use with `PRELOAD` and one compute thread.

    The server is started in this process's environment with OMP_NUM_THREADS=1, as a user's shell
    gives `main.py` (conftest's `main_env`): OpenMP reads it once, when torch loads it into the
    server, and every process forked from there keeps that pool; with the variable unset a job ran
    its steps on two OpenMP threads and took 16-21 s instead of 4-6 s on the loaded 2-core machine."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()  # a no-op once it runs
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return ctx


def _has_sitecustomize(folder: str) -> bool:
    return bool(folder) and os.path.isfile(os.path.join(folder, "sitecustomize.py"))


def main_job(request: dict) -> None:
    """One `python main.py` job in a child of the fork server: `request` holds "argv", "cwd", "env",
    and the files for its stdout and stderr ("out", "err"). Ends the process with main.py's status."""
    os.setsid()  # its own process group: a timeout kills the job and its ranks together
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    # What the interpreter's `site` does at start for a PYTHONPATH folder holding sitecustomize.py
    # (the tests' fault injection, which patches attributes of modules already imported here):
    # import it, now that the environment is the request's.
    hooks = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if _has_sitecustomize(p)]
    if hooks:
        sys.path[:0] = hooks
        sys.modules.pop("sitecustomize", None)
        import sitecustomize  # noqa: F401
    sys.argv = [MAIN, *request["argv"]]
    code = 0
    try:
        runpy.run_path(MAIN, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, status 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
