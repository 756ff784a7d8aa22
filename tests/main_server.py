"""Runs `python main.py ARGS` for the tests without paying the interpreter's start each time.

[Note: the tests' main.py server]
Most end-to-end tests run `python main.py ...` as a user would, a few hundred times in the suite;
each start spent ~4 s importing torch, Hydra and the framework before the job's own work, most of
a tiny job's wall time. This server imports them once (and what many jobs' ranks would import
again: megatron.core for the indexed data, transformers for model=hf; the ranks are forked from the
job), then forks one child per request: the
child takes the request's working directory, environment and argv, sends its stdout/stderr to
files, and runs main.py as `__main__` (`runpy.run_path`): the same code path as the command line,
from a process whose only history is those imports (no thread started, no torch op run). The
server reports the child's pid, then its exit status as `subprocess` would give it (-N for a
signal). `tests/conftest.py:run_main` uses it when the environment asks for nothing the
interpreter reads at start (its PYTHONPATH is the repository's, possibly after folders holding a
`sitecustomize.py`, which the child imports as `site` would), and so does `start_main` for a job
the test signals while it runs (without a launcher such as torchrun); otherwise a real subprocess.

Protocol: one JSON object per line on stdin {"argv", "cwd", "env", "out", "err"}; replies on stdout
{"pid": N}, then {"rc": N}.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "main.py")


def _has_sitecustomize(folder: str) -> bool:
    return bool(folder) and os.path.isfile(os.path.join(folder, "sitecustomize.py"))


def _child(request: dict) -> None:
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


def _preload_transformers() -> None:
    """transformers and the modules a model=hf job reaches (~2.5 s of every such job's ranks on
    two cores: its model classes and their torchao/accelerate checks load on first use)."""
    import transformers  # noqa: F401 - pinned in requirements.lock
    import transformers.activations  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401


def serve() -> None:
    import hydra  # noqa: F401 - imported once here, for every job
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401 - ~1.7 s, imported by every job (the engine's hooks, meta fills)

    import framework.data.indexed  # noqa: F401 - megatron.core, ~2.8 s: every job on the stdlib or indexed data
    import framework.distributed.fsdp  # noqa: F401
    import framework.entrypoint  # noqa: F401
    import framework.trainer  # noqa: F401

    _preload_transformers()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(MAIN))
    serve()
