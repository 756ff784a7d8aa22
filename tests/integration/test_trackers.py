"""Trackers as users run them: TensorBoard, W&B (offline) and a real MLflow server on loopback,
read back through each tool's own reader, across a SIGTERM requeue."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import TINY, free_port, pinned_import, read_metrics, run_main, start_main

pinned_import("wandb")
pinned_import("mlflow")

BIN = Path(sys.executable).parent
SENTINEL = "wandb-key-sentinel-5f1e2d"  # a fake W&B key: must appear in no file and no log
ARGS = [
    *[a for a in TINY if not a.startswith(("logging.tensorboard", "logging.loss_plot"))],
    "logger=[tensorboard,wandb,mlflow]",
    "logging.wandb.project=trackers-test",
    "logging.wandb.name=requeued",
    "logging.wandb.group=g1",
    "logging.wandb.tags=[a,b]",
    "logging.mlflow.experiment=trackers-test",
    "trainer.max_steps=10",
    "trainer.eval_interval=5",
    "checkpoint.interval=2",
    "checkpoint.resume=auto",
]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` with a sqlite backend store on a loopback port, as a team runs it."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/store.db"]
        + ["--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port)]
        + ["--workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        # the tracking API is what a run talks to; the server's job runner and its workers (for
        # GenAI evaluation jobs) would only take the test's cores while they start
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        yield uri
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _wandb_records(run_dir: Path):
    """Every record of every offline W&B file of the run, through `wandb leet inspect --json`."""
    records = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run(
            [str(BIN / "wandb"), "leet", "inspect", "--json", str(path)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        records.append([json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")])
    return records


def _tensorboard_losses(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = {}
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for event in acc.Scalars("loss"):
            losses[event.step] = event.value  # a redone step: the later value
    return losses


def test_three_trackers_log_every_step_and_continue_after_a_requeue(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    args = [*ARGS, f"logging.mlflow.tracking_uri={mlflow_server}", f"hydra.run.dir={run}"]
    env = {"WANDB_API_KEY": SENTINEL}
    proc = start_main(args, cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        first_out, first_err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, first_err[-3000:]
    stopped_at = read_metrics(run)[-1]["step"]
    assert 5 <= stopped_at < 10
    second = run_main(args, tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed at step {stopped_at}" in second.stderr

    # metrics.jsonl: every step once
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 11))
    losses = {r["step"]: r["loss"] for r in records}
    assert records[4]["val_loss"] > 0 and records[9]["val_loss"] > 0

    # TensorBoard keeps float32
    assert _tensorboard_losses(run) == pytest.approx(losses, rel=1e-6)

    # W&B: two offline files (one per attempt) of the same run, named and configured from config
    identity = json.loads((run / "trackers.json").read_text())
    attempts = _wandb_records(run)
    assert len(attempts) == 2
    wandb_losses = {}
    for attempt in attempts:
        (header,) = [r["run"] for r in attempt if r.get("type") == "run"]
        assert header["run_id"] == identity["wandb"]
        assert header["project"] == "trackers-test" and header["display_name"] == "requeued"
        assert header["run_group"] == "g1" and header["tags"] == ["a", "b"]
        config = header["config"]["update"]  # the resolved config, as sections
        assert config["optimizer"]["lr"] > 0 and config["trainer"]["max_steps"] == 10
        for r in attempt:
            if r.get("type") == "history":
                wandb_losses[r["history"]["step"]["num"]] = r["history"]["item"]["loss"]
    assert wandb_losses == losses

    # MLflow: one run in the experiment, continued, every step's loss (a redone step twice, equal)
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("trackers-test")
    (only,) = client.search_runs([experiment.experiment_id])
    assert only.info.run_id == identity["mlflow"]["run_id"] and only.info.status == "FINISHED"
    assert only.data.params["optimizer.lr"] and only.data.tags["mlflow.runName"] == "run"
    history = client.get_metric_history(only.info.run_id, "loss")
    assert {m.step for m in history} == set(losses)
    for m in history:
        assert m.value == pytest.approx(losses[m.step], rel=1e-6, abs=0)
    assert {m.step for m in client.get_metric_history(only.info.run_id, "val_loss")} == {5, 10}

    # no credential anywhere: run directory (every file, binary too) and both attempts' output
    for path in run.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert SENTINEL.encode() not in path.read_bytes(), path
    assert SENTINEL not in first_out + first_err + second.stdout + second.stderr

    # loss.png: a PNG picture of the whole run
    png = (run / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 800


def test_a_tracker_that_cannot_start_is_one_line_before_training(tmp_path):
    """An MLflow server that does not answer: every rank ends with status 2 and one line naming the
    setting, before any step (nothing in metrics.jsonl)."""
    run = tmp_path / "run"
    out = run_main(
        [*TINY, "logger=[mlflow]", f"logging.mlflow.tracking_uri=http://127.0.0.1:{free_port()}"]
        + [f"hydra.run.dir={run}", "trainer.max_steps=3"],
        tmp_path,
        env={"MLFLOW_HTTP_REQUEST_TIMEOUT": "5"},
    )
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "logging.mlflow.tracking_uri" in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not (run / "metrics.jsonl").exists() or read_metrics(run) == []


def test_a_password_in_the_tracking_uri_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    out = run_main(
        [*TINY, "logger=[mlflow]", "logging.mlflow.tracking_uri=http://me:hunter2@127.0.0.1:5000"]
        + [f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert out.returncode == 2 and "MLFLOW_TRACKING_PASSWORD" in out.stderr
    assert "hunter2" not in out.stderr + out.stdout
    assert not run.exists() or not any("hunter2" in p.read_text() for p in run.rglob("*") if p.is_file())
