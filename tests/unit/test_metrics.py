"""metrics.jsonl after a resume: every step once, as in an uninterrupted run."""

import json

from framework.metrics import MetricsLogger


def _logger(run_dir, start_step):
    return MetricsLogger(
        str(run_dir),
        enabled=True,
        total_steps=10,
        start_step=start_step,
        jsonl=True,
        progress_bar=False,
        loss_plot=True,
        tokens_per_step=128,
    )


def test_resume_drops_the_unfinished_attempts_later_steps(tmp_path):
    first = _logger(tmp_path, 0)
    for step in range(1, 6):
        first.log(step, {"loss": 10.0 - step})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "lo')  # the crash cut the last record short
    # The restarted attempt resumes from the checkpoint of step 3 and redoes steps 4 and 5.
    second = _logger(tmp_path, 3)
    for step in range(4, 7):
        second.log(step, {"loss": 100.0 + step})
    # loss.png's curve is the whole run's: the kept records, then the new ones
    assert [(h["step"], h["loss"]) for h in second.history] == [
        (1, 9.0),
        (2, 8.0),
        (3, 7.0),
        (4, 104.0),
        (5, 105.0),
        (6, 106.0),
    ]
    second.plot()
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG" and not list(tmp_path.glob("loss.png.tmp*"))
    second.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in records] == [9.0, 8.0, 7.0, 104.0, 105.0, 106.0]


def test_a_fresh_start_keeps_nothing_to_drop(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    _logger(tmp_path, 1).close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning_and_the_others_go_on(tmp_path, capsys):
    from framework.trackers import Trackers

    class Broken:
        name = "mlflow"

        def log(self, step, values):
            raise ConnectionError("server went away\nsecond line")

        def close(self):
            raise AssertionError("a dropped tracker is not closed again")

    class Kept:
        name = "wandb"

        def __init__(self):
            self.seen, self.closed = [], False

        def log(self, step, values):
            self.seen.append((step, values["loss"]))

        def close(self):
            self.closed = True

    kept = Kept()
    trackers = Trackers([Broken(), kept])
    logger = MetricsLogger(
        str(tmp_path), enabled=True, total_steps=3, start_step=0, jsonl=True, progress_bar=False, trackers=trackers
    )
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("warning: mlflow stopped working (ConnectionError: server went away)") == 1
    assert kept.seen == [(1, 1.0), (2, 2.0), (3, 3.0)] and kept.closed
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
