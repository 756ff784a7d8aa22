"""Generation with and without the KV cache (framework/generation) on the default model (model=small:
conf/model/small.yaml, its vocabulary 2048 as the stdlib tokenizer gives it), one process, CPU, fp32.

    .venv/bin/python bench/generate.py --out bench/results/generate.json

Greedy decoding of `--new` tokens (no end-of-text stop) after a prompt of `--prompt` random tokens,
batches of 1 and of `--batch` prompts; each timing is the median of `--repeats` calls after one
warm-up, in CPU seconds of this process (one thread: the work itself, which other jobs on a shared
machine do not inflate) and in wall seconds. The cached and recomputed runs must give the same
tokens (checked). Writes a table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from framework.config.schema import ModelConfig  # noqa: E402
from framework.generation import generate  # noqa: E402
from framework.models import family_of  # noqa: E402

VOCAB = 2048  # the stdlib tokenizer's size, which model=small takes (vocab_size: -1)


def build_small():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "conf", "model", "small.yaml")) as f:
        args = yaml.safe_load(f)["args"]
    args["vocab_size"] = VOCAB
    cfg = ModelConfig(name="small", args=args)
    family = family_of(cfg)
    model = family.build(cfg, "cpu")
    family.init_weights(model, 0)
    return model.eval(), args


def timed(model, prompts, new: int, use_cache: bool, repeats: int):
    """(median wall seconds, median CPU seconds of this process, the tokens) of `repeats` calls. With
    one thread the CPU seconds are the work itself, which other jobs on a shared machine do not
    inflate (they stretch the wall time while this process waits for a core)."""
    generate(model, prompts, new, use_cache=use_cache)  # warm-up
    wall, cpu, out = [], [], None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = generate(model, prompts, new, use_cache=use_cache)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), [c.token_ids for c in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, args = build_small()
    load_before = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, a.batch):
        prompts = torch.randint(0, VOCAB, (batch, a.prompt), generator=gen).tolist()
        cached, cached_cpu, ids = timed(model, prompts, a.new, True, a.repeats)
        full, full_cpu, full_ids = timed(model, prompts, a.new, False, a.repeats)
        assert ids == full_ids, "the cached and recomputed tokens differ"
        rows.append(
            {
                "batch": batch,
                "cached_cpu_s": round(cached_cpu, 4),
                "recomputed_cpu_s": round(full_cpu, 4),
                "speedup_cpu": round(full_cpu / cached_cpu, 2),
                "cached_wall_s": round(cached, 4),
                "recomputed_wall_s": round(full, 4),
                "speedup_wall": round(full / cached, 2),
                "same_tokens": True,
            }
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "command": "python bench/generate.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "model": {k: args[k] for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len")},
        "params": sum(p.numel() for p in model.parameters()),
        "prompt_tokens": a.prompt,
        "new_tokens": a.new,
        "threads": a.threads,
        "cpu": os.cpu_count(),
        "torch": torch.__version__,
        # the machine's 1-minute load average before and after: timings on a shared machine move with it
        "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "rows": rows,
    }
    print(
        f"model=small ({result['params'] / 1e6:.2f}M params), prompt {a.prompt}, {a.new} new tokens, greedy, "
        f"CPU, {a.threads} thread(s), load average {result['load_average'][0]} -> {result['load_average'][1]}"
    )
    print(
        "| batch | cached CPU s | recomputed CPU s | speedup (CPU) "
        "| cached wall s | recomputed wall s | speedup (wall) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['cached_cpu_s']:.3f} | {r['recomputed_cpu_s']:.3f} | {r['speedup_cpu']:.2f}x "
            f"| {r['cached_wall_s']:.3f} | {r['recomputed_wall_s']:.3f} | {r['speedup_wall']:.2f}x |"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
