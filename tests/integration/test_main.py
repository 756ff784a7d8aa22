"""`python main.py` as a user runs it: Hydra conventions, refusals, training end to end."""

import json
import math
import os
import re

import pytest
from conftest import REPO, TINY, read_metrics, run_main, start_main


def test_help_lists_groups_and_choices(tmp_path):
    out = run_main(["--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    groups = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    for group in ("model", "parallelism", "optimizer", "data"):  # every option file is offered
        files = sorted(f[: -len(".yaml")] for f in os.listdir(REPO / "conf" / group))
        assert sorted(groups[group].split(", ")) == files, (group, groups.get(group))
    assert "parallelism: fsdp, hybrid, torch_fsdp, tp" in out.stdout
    assert not (tmp_path / "outputs").exists()


def test_cfg_job_prints_the_composed_config(tmp_path):
    out = run_main(["--cfg", "job", "model=llama_70b", "trainer.max_steps=3"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "n_kv_heads: 8" in out.stdout and "max_steps: 3" in out.stdout and "engine: native" in out.stdout


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["parallelism.dp_shard=3"], "must equal the world size (2)"),
        (
            ["parallelism.tp=2", "model.args.n_heads=3", "model.args.dim=96", "model.args.n_kv_heads=3"],
            "model.args.n_heads=3 is not divisible by parallelism.tp=2",
        ),
        (["trainer.global_batch_size=5"], "trainer.global_batch_size=5 is not divisible"),
        (["data.seq_len=2048"], "data.seq_len=2048 is longer than model.args.max_seq_len=1024"),
        (["model=gpt9"], "Could not find 'model/gpt9'"),
        (["parallelism.engine=jax"], "parallelism.engine"),
        (["parallelism.strategy=zero9"], "parallelism.strategy"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0: must be > 0"),
        (["optimizer.lr=-1"], "optimizer.lr=-1.0: must be > 0"),
        (["checkpoint.resume=/no/such/ckpt"], "checkpoint.resume=/no/such/ckpt: no such checkpoint"),
    ],
)
def test_bad_config_one_line_exit_2_nothing_written(tmp_path, overrides, needle):
    (tmp_path / "keep.txt").write_text("earlier work")
    out = run_main(TINY + overrides + [f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"]  # no run directory, nothing else touched
    if overrides[0].startswith(("parallelism.dp", "trainer", "data", "optimizer", "checkpoint")):
        assert len([line for line in out.stderr.splitlines() if line.startswith("error:")]) == 1


_FAULT_IN_FORWARD = """
import os
from framework.models.llama import Transformer

_forward = Transformer.forward


def forward(self, *args, **kwargs):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected fault in the model's forward")
    return _forward(self, *args, **kwargs)


Transformer.forward = forward
"""


def test_a_bug_in_a_rank_keeps_its_traceback_bad_paths_stay_one_line(tmp_path):
    """[Note: bad input vs bugs] under `python main.py` with 2 local ranks: an exception raised in
    rank 1's forward (a `sitecustomize` every rank imports plants it) is printed with its traceback
    and the rank, and the job fails with the crash status; a data path that does not hold a dataset,
    found by the ranks at start-up, is still one `error:` line and the bad-input status."""
    from framework.errors import EXIT_BAD_INPUT, EXIT_CRASH

    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_FAULT_IN_FORWARD)
    out = run_main(
        TINY + ["trainer.max_steps=3", f"hydra.run.dir={tmp_path}/crash"],
        tmp_path,
        env={"PYTHONPATH": f"{inject}{os.pathsep}{REPO}"},
    )
    assert out.returncode == EXIT_CRASH, (out.returncode, out.stderr[-3000:])
    assert "Traceback (most recent call last)" in out.stderr, out.stderr[-3000:]
    assert "RuntimeError: injected fault in the model's forward" in out.stderr
    assert re.search(r"rank 1\b.* failed", out.stderr), out.stderr[-3000:]  # named by its rank

    # An .idx without its .bin passes the config check (which looks for the .idx) and is refused by
    # the ranks when they open the dataset.
    (tmp_path / "half.idx").write_bytes(b"")
    indexed = [a for a in TINY if not a.startswith("data=")] + ["data=indexed", "data.seq_len=64"]
    out = run_main(indexed + [f"data.paths=[{tmp_path}/half]", f"hydra.run.dir={tmp_path}/bad"], tmp_path)
    assert out.returncode == EXIT_BAD_INPUT, (out.returncode, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: data.paths: {tmp_path}/half.bin not found; prepare it with stage=data_preparation"], (
        out.stderr[-3000:]
    )
    assert "Traceback" not in out.stderr


def test_nan_loss_stops_and_names_the_step(tmp_path):
    run = tmp_path / "run"
    out = run_main(
        TINY
        + [
            "parallelism.engine=torch",
            "optimizer=sgd",
            "optimizer.lr=1e12",
            "optimizer.clip_grad_norm=0",
            "trainer.max_steps=8",
            "checkpoint.save_final=true",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert out.returncode == 3, out.stderr
    assert "loss is nan at step 3" in out.stdout + out.stderr
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


def _losses(tmp_path, name, nproc, engine, steps=8):
    run = tmp_path / name
    out = run_main(
        TINY
        + [
            f"parallelism.engine={engine}",
            f"cluster.nproc_per_node={nproc}",
            f"trainer.max_steps={steps}",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=2",
            "trainer.eval_interval=4",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=1",
            "checkpoint.save_final=false",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return read_metrics(run)


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_one_and_two_ranks_give_the_same_losses(tmp_path, engine):
    one = _losses(tmp_path, "one", 1, engine)
    two = _losses(tmp_path, "two", 2, engine)
    assert [r["step"] for r in two] == list(range(1, 9))
    # Same samples per step (the loader's global order), same initial weights; only the order of
    # the fp32 gradient sums differs (2 ranks reduce 2 partial sums, 1 rank accumulates 4 micro
    # batches), a relative error of ~1e-7 per step that AdamW carries forward: 1e-4 bounds 8 steps.
    for a, b in zip(one, two):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-4), (a, b)
    assert math.isclose(one[-1]["val_loss"], two[-1]["val_loss"], rel_tol=1e-4)
    assert two[-1]["loss"] < two[0]["loss"] - 0.3  # and it learns


def test_multirun_sweep_runs_each_job(tmp_path):
    out = run_main(
        ["-m"]
        + TINY
        + [
            "optimizer=adamw,sgd",
            "cluster.nproc_per_node=1",
            "parallelism.engine=torch",
            "trainer.max_steps=2",
            "checkpoint.save_final=false",
            f"hydra.sweep.dir={tmp_path}/sweep",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    for job in ("0", "1"):
        assert [r["step"] for r in read_metrics(tmp_path / "sweep" / job)] == [1, 2]
    saved = (tmp_path / "sweep" / "1" / "config.yaml").read_text()
    assert "name: sgd" in saved


def test_default_job_end_to_end_on_a_tiny_budget(tmp_path):
    """`python main.py` as `make run` runs it (stdlib corpus, small model, 2 ranks, our engine),
    cut to a few steps."""
    run = tmp_path / "run"
    out = run_main(
        [
            "trainer.max_steps=40",
            "trainer.eval_interval=20",
            "trainer.sample_tokens=24",
            "optimizer.warmup_steps=5",
            "checkpoint.save_final=false",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 41))
    first = records[0]["loss"]
    last = sum(r["loss"] for r in records[-5:]) / 5  # one batch per step is noisy: average five
    # From log(vocab) = 7.6 at initialisation to below the corpus's unigram entropy (6.34 nats):
    # within 40 steps the model has learned at least the token frequencies.
    assert last < first - 1.0 and last < 6.7, (first, last)
    assert records[19]["val_loss"] > records[-1]["val_loss"]
    for key in (
        "grad_norm",
        "lr",
        "tokens_per_s",
        "step_time_s",
        "peak_memory_gib",
        "exposed_comm_s",
        "comm_bytes",
        "tflops_per_device",
    ):
        assert key in records[-1], key
    # the end-of-run sample starts from the validation data's text (a 16-token prompt) and goes on
    sample = out.stderr.split("--- sample ---\n")[1].split("\n--------------")[0]
    assert len(sample.strip()) > 20, sample
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_sigterm_to_main_reaches_the_local_ranks(tmp_path):
    """`kill <main.py>` (what a scheduler or a user does) is passed on to the ranks main.py started:
    they save a checkpoint and exit with the requeue status."""
    import signal
    import time

    run = tmp_path / "run"
    proc = start_main(
        [
            *TINY,
            "trainer.max_steps=100000",
            "checkpoint.interval=0",
            "checkpoint.save_final=true",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("_")[1]) == read_metrics(run)[-1]["step"]


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_meta_init_after_sharding_trains(tmp_path, engine):
    """model.meta_init=true: built on the meta device, each rank initialises only its shards."""
    run = tmp_path / "run"
    out = run_main(
        TINY
        + [
            f"parallelism.engine={engine}",
            "model.meta_init=true",
            "trainer.max_steps=12",
            "trainer.global_batch_size=8",
            "trainer.micro_batch_size=2",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=1",
            "checkpoint.save_final=false",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(run)]
    # Small initial weights give near-uniform logits: the first loss is ln(vocab) = ln(256).
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)
    assert losses[-1] < losses[0] - 0.3


_COUNT_BLOCK_FORWARDS = """
import json
import os

import torch
from framework.models.llama.model import TransformerBlock

_forward = TransformerBlock.forward
_calls = {}


def forward(self, *args, **kwargs):
    # Calls with autograd on: the training forward and its recomputation in backward (not evaluation).
    if torch.is_grad_enabled():
        key = _calls.setdefault(id(self), [len(_calls), 0])
        key[1] += 1
        with open(os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ.get("RANK", "0")), "w") as f:
            json.dump(sorted(_calls.values()), f)
    return _forward(self, *args, **kwargs)


TransformerBlock.forward = forward
"""


def test_activation_checkpointing_recomputes_exactly(tmp_path):
    """Recomputing blocks in backward gives the same numbers as keeping their activations, and the
    blocks are recomputed: each block's forward runs twice per micro-batch under `full`, the even
    blocks' twice and the odd blocks' once under `selective`, once without (a `sitecustomize` every
    rank imports counts the calls)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(_COUNT_BLOCK_FORWARDS)
    base = TINY + [
        "cluster.nproc_per_node=2",
        "trainer.max_steps=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "checkpoint.save_final=false",
    ]
    micro_batches = 4 * (8 // 2) // 2  # per rank: 4 steps x (8 rows / 2 ranks) / 2 rows per micro-batch
    runs, calls = {}, {}
    for mode in ("none", "full", "selective"):
        counts = tmp_path / f"calls_{mode}"
        counts.mkdir()
        out = run_main(
            base + [f"parallelism.activation_checkpointing={mode}", f"hydra.run.dir={tmp_path / mode}"],
            tmp_path,
            env={"PYTHONPATH": f"{inject}{os.pathsep}{REPO}", "COUNT_DIR": str(counts)},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[mode] = [r["loss"] for r in read_metrics(tmp_path / mode)]
        calls[mode] = {f.name: [n for _, n in json.loads(f.read_text())] for f in counts.iterdir()}
    assert runs["full"] == runs["none"] and runs["selective"] == runs["none"]
    # debug has 2 blocks; every rank runs every block on each of its micro-batches.
    once, twice = micro_batches, 2 * micro_batches
    assert calls["none"] == {"rank0": [once, once], "rank1": [once, once]}, calls
    assert calls["full"] == {"rank0": [twice, twice], "rank1": [twice, twice]}, calls
    assert calls["selective"] == {"rank0": [twice, once], "rank1": [twice, once]}, calls


def test_quantized_comm_from_the_config(tmp_path):
    """parallelism.quantized_comm=true reaches the engine: fewer bytes, nearly the same losses."""
    runs = {}
    for flag in ("false", "true"):
        run = tmp_path / flag
        out = run_main(
            TINY
            + [
                f"parallelism.quantized_comm={flag}",
                "trainer.max_steps=6",
                "checkpoint.save_final=false",
                f"hydra.run.dir={run}",
            ],
            tmp_path,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs[flag] = read_metrics(run)
    # int8 values plus one fp32 scale per 256 replace fp32 words: about a quarter of the bytes.
    assert runs["true"][-1]["comm_bytes"] < 0.3 * runs["false"][-1]["comm_bytes"]
    # The fp32 master shards stay exact; only the gathered copies and reduced gradients carry
    # int8 rounding (<1% per block), which moves a 6-step loss by far less than 1%.
    for plain, quantized in zip(runs["false"], runs["true"]):
        assert quantized["loss"] == pytest.approx(plain["loss"], rel=1e-2)


def test_batch_logs_get_a_line_per_log_interval_not_a_progress_bar(tmp_path, capsys):
    """stderr is a file here, as in a Slurm .err file or kubectl logs: by default no progress bar
    (which rewrites one line with carriage returns) but one line per trainer.log_interval steps;
    trainer.progress_bar=true asks for the bar anyway (checked on the logger itself, no second job)."""
    from framework.metrics import MetricsLogger

    base = [a for a in TINY if not a.startswith("trainer.progress_bar")]
    out = run_main(base + ["trainer.max_steps=4", "trainer.log_interval=2", f"hydra.run.dir={tmp_path}/a"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    bar_drawn = lambda err: re.search(r"\d+%\|", err) is not None  # tqdm's "50%|#####" (text mode eats its \r)
    assert not bar_drawn(out.stderr), out.stderr[-2000:]
    assert re.findall(r"^step (\d)/4: loss ", out.stderr, re.M) == ["2", "4"], out.stderr[-2000:]
    logger = MetricsLogger(
        str(tmp_path / "b"),
        enabled=True,
        total_steps=2,
        start_step=0,
        jsonl=False,
        progress_bar=True,
    )
    for _ in range(2):
        logger.progress({"loss": 1.0})
    logger.close()
    err = capsys.readouterr().err
    assert bar_drawn(err) and "step 2/2: loss" not in err, err
