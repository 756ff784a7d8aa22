"""Run PyTorch's own FSDP2 tests (`test/distributed/_composable/fsdp/` of the torch source at the
version in .venv) against our engine and against torch's `fully_shard`, on CPU ranks with gloo.

    .venv/bin/python bench/upstream_fsdp2/run.py PATH/TO/fsdp-tests [-k EXPR] [--engine both]

PATH holds the upstream test files as torch's source tree has them: the user brings them (a
torch checkout, or the files saved from it); nothing of them is stored in this repository and
nothing is downloaded. They are copied to a temporary folder outside the repository for the
run, where two textual adjustments make files written for CUDA-only runs take CPU ranks
(`--no-cpu-rewrite` turns both off):
  * a hard-coded "cuda" device (`device="cuda"`, `.cuda()`, `init_device_mesh("cuda", ...)`)
    becomes the CPU;
  * `@skip_if_lt_x_gpu(n)` becomes `@skip_if_lt_x_gpu(n, allow_cpu=True)` (torch's own switch
    for tests that also run on CPU ranks).
Every Python process of the run (spawned ranks too) imports `shim/sitecustomize.py`, which,
for `--engine ours`, rebinds the public names of `torch.distributed.fsdp` to ours; `shim/`
also holds a stand-in for the `expecttest` package torch's test helpers import.

The table lists each test's outcome per engine; the count that matters is how many of the
tests torch's engine passes here ours passes too. JSON of the outcomes: --json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "shim"

_REWRITES = (
    (re.compile(r"""device=(["'])cuda\1"""), 'device="cpu"'),
    (re.compile(r"""init_device_mesh\(\s*(["'])cuda\1"""), 'init_device_mesh("cpu"'),
    (re.compile(r"""torch\.device\((["'])cuda\1\)"""), 'torch.device("cpu")'),
    (re.compile(r"\.cuda\(\)"), ".cpu()"),
    (re.compile(r"@skip_if_lt_x_gpu\((\d+)\)"), r"@skip_if_lt_x_gpu(\1, allow_cpu=True)"),
)


def _refuse(message: str) -> None:
    """Bad input: one line, exit status 2."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def materialise(src: Path, rewrite: bool) -> Path:
    """Copy the upstream test files to a fresh temporary folder (outside the repository)."""
    dst = Path(tempfile.mkdtemp(prefix="upstream_fsdp2_"))
    for f in sorted(src.glob("*.py")):
        text = f.read_text()
        if rewrite:
            for pattern, repl in _REWRITES:
                text = pattern.sub(repl, text)
        (dst / f.name).write_text(text)
    return dst


def run_engine(engine: str, files: list, args, workdir: Path) -> dict:
    """{test id: (outcome, first line of the failure)} for one engine."""
    xml = workdir / f"junit_{engine}.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["UPSTREAM_FSDP2_ENGINE"] = engine
    env.setdefault("OMP_NUM_THREADS", "1")
    env["UPSTREAM_FSDP2_CPU_RANKS"] = str(args.cpu_ranks)
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "-p", "no:cacheprovider", "-q", "-n", "0"]
    cmd += ["-o", "addopts=", f"--junitxml={xml}", f"--timeout={args.timeout}", "--rootdir", str(workdir)]
    if args.k:
        cmd += ["-k", args.k]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True)
    print(f"[{engine}] {time.time() - t0:.0f} s, pytest exit {proc.returncode}", file=sys.stderr)
    if not xml.exists():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"pytest wrote no report for engine={engine}")
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                why = (node.get("message") or "").strip().splitlines()[0:1]
                why = why[0][:160] if why else ""
                break
        out[name] = (outcome, why)
    return out


def _repeated(engine: str, files: list, args, workdir: Path) -> dict:
    """`--repeat N` runs: a test passes only if it passed every run ("passed" then says N/N)."""
    runs = [run_engine(engine, files, args, workdir) for _ in range(args.repeat)]
    if args.repeat == 1:
        return runs[0]
    out = {}
    for t in set().union(*runs):
        seen = [r.get(t, ("absent", "")) for r in runs]
        passes = sum(o == "passed" for o, _ in seen)
        failed = [w for o, w in seen if o != "passed"]
        if passes == len(runs):
            out[t] = ("passed", f"{passes}/{len(runs)}")
        else:
            outcome = "skipped" if all(o == "skipped" for o, _ in seen) else "failed"
            out[t] = (outcome, f"{passes}/{len(runs)} passed; {failed[0]}")
    return out


def summarise(results: dict, repeat: int = 1) -> str:
    """The table of outcomes per engine and, with both engines, how many of the tests torch's
    engine passes ours passes too."""
    engines = list(results)
    tests = sorted(set().union(*results.values()))
    lines = ["| test | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for t in tests:
        cells = []
        for e in engines:
            outcome, why = results[e].get(t, ("absent", ""))
            cells.append(outcome + (f": {why}" if why and (outcome == "failed" or repeat > 1) else ""))
        lines.append(f"| {t} | " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    for e in engines:
        n = sum(1 for o, _ in results[e].values() if o == "passed")
        lines.append(f"{e}: {n} passed of {len(results[e])} collected")
    if "torch" in results and "ours" in results:
        base = [t for t in tests if results["torch"].get(t, ("",))[0] == "passed"]
        ours = [t for t in base if results["ours"].get(t, ("",))[0] == "passed"]
        lines.append(f"ours passes {len(ours)} of the {len(base)} tests torch's fully_shard passes")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tests_dir", type=Path, help="folder with torch's test/distributed/_composable/fsdp/ files")
    p.add_argument("--files", nargs="*", default=None, help="file names within tests_dir (default: all test_*.py)")
    p.add_argument("-k", default=None, help="pytest -k expression")
    p.add_argument("--engine", choices=("ours", "torch", "both"), default="both")
    p.add_argument("--timeout", type=int, default=600, help="seconds per test")
    p.add_argument("--repeat", type=int, default=1, help="run each engine's tests N times; pass = every run")
    p.add_argument("--no-cpu-rewrite", action="store_true")
    p.add_argument("--cpu-ranks", type=int, default=2, help="gloo ranks for tests sized by the device count")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not args.tests_dir.is_dir():
        _refuse(f"tests_dir={args.tests_dir}: no such folder; give torch's test/distributed/_composable/fsdp")
    work = materialise(args.tests_dir, rewrite=not args.no_cpu_rewrite)
    try:
        names = args.files or sorted(f.name for f in work.glob("test_*.py"))
        files = [work / n for n in names]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            _refuse(f"--files: not in {args.tests_dir}: {', '.join(missing)}")
        engines = ("torch", "ours") if args.engine == "both" else (args.engine,)
        results = {e: _repeated(e, files, args, work) for e in engines}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(summarise(results, args.repeat))
    if args.json:
        args.json.write_text(json.dumps({e: {t: list(v) for t, v in r.items()} for e, r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
