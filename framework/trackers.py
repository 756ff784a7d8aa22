"""Experiment trackers on rank 0: TensorBoard, Weights & Biases and MLflow (`logger=[...]`).

Each tracker is opened once, before the first step, and receives every metrics record the JSONL
file gets. A tracker that cannot start (no package, a server that does not answer, a W&B login
missing) is one line and status 2 before training begins; one that fails later (its server went
away) is one warning line and the run goes on without it.

[Note: one tracker run per training run]
A run that restarts in the same run directory (a requeue, a crash, `checkpoint.resume=auto`)
continues the same W&B run and the same MLflow run: their ids are kept in `<run>/trackers.json`
and reused whenever the job resumes from a step > 0. A fresh start (step 0) in that directory opens
new ones. Steps redone after a resume are logged again with the same values (resume is exact).

No credential is passed through here or written anywhere: W&B reads WANDB_API_KEY and MLflow its
MLFLOW_TRACKING_* variables from the environment (the launcher's cluster.secret_env puts them
there by reference), and a tracking URI holding a credential (user info, a token or key in its
query, a fragment) is refused by the config.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional

from framework.errors import UserInputError
from framework.fileio import create_temporary, open_regular

TOOLS_LOCK = "pip install -r requirements-tools.lock (make venv installs it)"
IDENTITY_FILE = "trackers.json"


def _require(module: str, setting: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UserInputError(f"{setting} needs the {module} package ({exc}): {TOOLS_LOCK}") from None


def _numbers(values: Dict[str, object]) -> Dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        # The events file is made at the first record: a job refused after its trackers opened (a
        # later tracker, an evaluation's tasks) leaves none behind.
        self._dir, self._make, self._writer = os.path.join(run_dir, "tensorboard"), SummaryWriter, None

    def log(self, step: int, values: Dict[str, object]) -> None:
        if self._writer is None:
            self._writer = self._make(self._dir)
        for key, value in _numbers(values).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class Wandb:
    name = "wandb"

    def __init__(self, settings, run_dir: str, config: dict, run_id: Optional[str]):
        wandb = _require("wandb", "logging.wandb")
        self._wandb = wandb
        try:
            self.run = wandb.init(
                project=settings.project,
                entity=settings.entity or None,
                name=settings.name or os.path.basename(os.path.normpath(run_dir)),
                group=settings.group or None,
                tags=list(settings.tags) or None,
                mode=settings.mode,
                dir=run_dir,
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(console="off", save_code=False, x_disable_stats=True, silent=True),
            )
        except Exception as exc:  # noqa: BLE001 - wandb raises its own types for login, network, mode
            raise UserInputError(
                f"logging.wandb: W&B did not start ({type(exc).__name__}: {_first_line(exc)}); for mode=online "
                "set WANDB_API_KEY in the environment (cluster.secret_env.WANDB_API_KEY=<source> in a job), "
                "or use logging.wandb.mode=offline and `wandb sync` later"
            ) from None
        self.id = self.run.id

    def log(self, step: int, values: Dict[str, object]) -> None:
        self.run.log(_numbers(values), step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    name = "mlflow"

    def __init__(self, settings, run_dir: str, config: dict, run_id: Optional[str]):
        # a server that does not answer is said at once, not after minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        tracking = _require("mlflow.tracking", "logging.mlflow")
        import logging

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its table-creation chatter
        self.uri = settings.tracking_uri or "sqlite:///" + os.path.join(os.path.abspath(run_dir), "mlflow.db")
        try:
            self._client = tracking.MlflowClient(tracking_uri=self.uri)
            if run_id is None:
                experiment = self._client.get_experiment_by_name(settings.experiment)
                experiment_id = (
                    experiment.experiment_id if experiment else self._client.create_experiment(settings.experiment)
                )
                tags = {**settings.tags, "mlflow.runName": settings.run_name or os.path.basename(run_dir)}
                run_id = self._client.create_run(experiment_id, tags=tags).info.run_id
                self._log_config(run_id, config)
            else:
                self._client.update_run(run_id, status="RUNNING")
        except Exception as exc:  # noqa: BLE001 - connection, permission and store errors alike
            raise UserInputError(
                f"logging.mlflow.tracking_uri={settings.tracking_uri or self.uri!r}: MLflow did not start "
                f"({type(exc).__name__}: {_first_line(exc)}); is the server running and reachable from rank 0?"
            ) from None
        self.id = run_id

    def _log_config(self, run_id: str, config: dict) -> None:
        from mlflow.entities import Param

        flat = _flatten(config)
        params = [Param(k, str(v)[:6000]) for k, v in sorted(flat.items())]
        for start in range(0, len(params), 100):  # MLflow's batch limit
            self._client.log_batch(run_id, params=params[start : start + 100])

    def log(self, step: int, values: Dict[str, object]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _numbers(values).items()]
        self._client.log_batch(self.id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.id)


REACH_TIMEOUT_S = 3.0  # a server's TCP accept takes milliseconds; a dropped packet would wait this long


def unreachable(logging_cfg) -> Optional[str]:
    """Before any rank starts: why the MLflow server an http(s) tracking URI names cannot be reached
    from here (nothing accepts a TCP connection at its host and port), or None. MLflow's own
    client in rank 0 would find the same only after its retries (17 s). A URI reached through a
    proxy (HTTP(S)_PROXY without NO_PROXY for the host) is left to the client, as are other schemes."""
    import socket
    import urllib.request
    from urllib.parse import urlsplit

    uri = logging_cfg.mlflow.tracking_uri
    if not logging_cfg.mlflow.enabled or not uri:
        return None
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if parts.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"logging.mlflow.tracking_uri={uri}: the port is not a number; give e.g. http://host:5000"
    try:
        socket.create_connection((parts.hostname, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        return (
            f"logging.mlflow.tracking_uri={uri}: nothing answers at {parts.hostname}:{port} ({why}); "
            "start the MLflow server, or give the address it listens on"
        )
    return None


def _flatten(tree, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else "no message"


class Trackers:
    """The open trackers; `log` goes to each, and one that fails is dropped with a warning."""

    def __init__(self, trackers: List[object]):
        self.trackers = trackers

    def log(self, step: int, values: Dict[str, object]) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.log(step, values)
            except Exception as exc:  # noqa: BLE001 - a tracker never ends a training run
                self._drop(tracker, exc)

    def _drop(self, tracker, exc: BaseException) -> None:
        self.trackers.remove(tracker)
        print(
            f"warning: {tracker.name} stopped working ({type(exc).__name__}: {_first_line(exc)}); "
            "training goes on without it (metrics.jsonl has every step)",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        for tracker in list(self.trackers):
            try:
                tracker.close()
            except Exception as exc:  # noqa: BLE001
                self._drop(tracker, exc)
        self.trackers = []


def open_trackers(logging_cfg, run_dir: str, config: dict, resumed: bool) -> Trackers:
    """Rank 0's trackers for this run (UserInputError if one cannot start). With `resumed`, the
    W&B and MLflow runs named in `<run>/trackers.json` are continued ([Note: one tracker run per
    training run])."""
    identity_path = os.path.join(run_dir, IDENTITY_FILE)
    known = _read_identity(identity_path) if resumed else {}
    opened: List[object] = []
    try:
        if logging_cfg.tensorboard:
            opened.append(TensorBoard(run_dir))
        if logging_cfg.wandb.enabled:
            opened.append(Wandb(logging_cfg.wandb, run_dir, config, known.get("wandb")))
        if logging_cfg.mlflow.enabled:
            mlflow = Mlflow(logging_cfg.mlflow, run_dir, config, _same_store(known.get("mlflow"), logging_cfg.mlflow))
            opened.append(mlflow)
    except BaseException:
        Trackers(opened).close()
        raise
    identity = {t.name: {"run_id": t.id, "tracking_uri": t.uri} for t in opened if isinstance(t, Mlflow)}
    identity.update({t.name: t.id for t in opened if isinstance(t, Wandb)})
    if identity:
        tmp = identity_path + ".tmp"
        with create_temporary(tmp) as handle:
            json.dump(identity, handle)
        os.replace(tmp, identity_path)
    return Trackers(opened)


def _same_store(known, settings) -> Optional[str]:
    """The MLflow run to continue: only one kept for this same tracking URI."""
    if not isinstance(known, dict) or not isinstance(known.get("run_id"), str):
        return None
    same = not settings.tracking_uri or known.get("tracking_uri") == settings.tracking_uri  # "": the run's own
    return known["run_id"] if same else None


def _read_identity(path: str) -> dict:
    if not os.path.lexists(path):
        return {}
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY)) as handle:  # a planted link is refused
            data = json.loads(handle.read(1 << 16))
    except (OSError, ValueError, UserInputError):
        return {}  # a damaged file starts new tracker runs; the training itself is unaffected
    return data if isinstance(data, dict) else {}
