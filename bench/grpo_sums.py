"""GRPO on a toy task: the tiny Llama (model=debug, 0.1M parameters, from its seeded initialisation)
learns to answer one-digit sums in a fixed format, on 2 CPU ranks.

    .venv/bin/python bench/grpo_sums.py                 # 200 steps; writes bench/results/grpo_sums.{json,txt}
    .venv/bin/python bench/grpo_sums.py --steps 20 --out /tmp/grpo_sums.json

The data (written into --work): a tokenizer trained on the 100 lines "Q: i+j= A: i+j" and a JSONL
file of the 100 prompts "Q: i+j= A:" with their answers i + j (4 held out for validation). The
reward is exact_match (the completion's first number equals the answer) plus 0.5 x format (the
completion starts with a number: " 7"). The job is the command printed first (docs/fine_tuning.md
"stage=grpo"); the table is the mean reward and its parts over windows of 20 steps, from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def write_data(work: str) -> tuple:
    from framework.data.tokenizer import EOD, train_bpe

    tok, data = os.path.join(work, "tok.json"), os.path.join(work, "sums.jsonl")
    train_bpe([f"Q: {i}+{j}= A: {i + j}{EOD}" for i in range(10) for j in range(10)], 300, tok)
    with open(data, "w") as f:
        for i in range(10):
            for j in range(10):
                f.write(json.dumps({"prompt": f"Q: {i}+{j}= A:", "answer": i + j}) + "\n")
    return tok, data


def command(tok: str, data: str, run_dir: str, steps: int) -> list:
    return [
        sys.executable,
        os.path.join(REPO, "main.py"),
        "experiment=grpo",
        f"data.paths=[{data}]",
        f"finetune.tokenizer={tok}",
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={run_dir}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--work", default="")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "grpo_sums.json"))
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="grpo_sums_")
    os.makedirs(work, exist_ok=True)
    tok, data = write_data(work)
    run_dir = os.path.join(work, "run")
    cmd = command(tok, data, run_dir, args.steps)
    print(" ".join(cmd[1:]).replace(REPO + "/", ""), flush=True)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return done.returncode
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "reward" in r]
    rows = []
    for start in range(0, len(steps), args.window):
        part = steps[start : start + args.window]
        row = {"steps": f"{part[0]['step']}-{part[-1]['step']}"}
        for name in ("reward", "rewards/exact_match", "rewards/format", "reward_std", "kl", "completion_length"):
            row[name] = sum(r.get(name, 0.0) for r in part) / len(part)
        rows.append(row)
    table = ["steps      reward  exact_match  format  reward_std      kl  completion_length"]
    table += [
        f"{r['steps']:<10} {r['reward']:6.3f}  {r['rewards/exact_match']:11.3f}  {r['rewards/format']:6.3f}  "
        f"{r['reward_std']:10.3f}  {r['kl']:6.3f}  {r['completion_length']:17.2f}"
        for r in rows
    ]
    vals = [r for r in records if "val_reward" in r]
    table += [f"val_reward (greedy, 4 held-out prompts) at step {r['step']}: {r['val_reward']:.3f}" for r in vals]
    text = "\n".join(table)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(cmd[1:]).replace(REPO + "/", ""), "windows": rows, "steps": steps}, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
        f.write("$ .venv/bin/python bench/grpo_sums.py\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
