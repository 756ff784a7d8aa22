"""A tracking URI never carries a credential: whatever part of it could hold one (a user name or
password before the host, a query under any parameter name, a path parameter after `;`, a
fragment), the job is refused in
one line naming logging.mlflow.tracking_uri and MLflow's own environment variables, quoting
nothing of the secret, and nothing is written (config.yaml would carry it to the trackers)."""

from __future__ import annotations

import pytest
from conftest import TINY, run_main

SECRET = "s3cr3t-9f8e7d"

URIS = [
    f"http://me:{SECRET}@127.0.0.1:5000",  # user and password
    f"http://{SECRET}@127.0.0.1:5000",  # a token as the user name
    f"https://mlflow.example/?token={SECRET}",
    f"https://mlflow.example/?x=1&api_key={SECRET}",
    f"https://mlflow.example/?Password={SECRET}",
    f"https://mlflow.example/?access_token={SECRET}",
    f"https://mlflow.example/?auth={SECRET}",
    f"https://mlflow.example/?client_secret={SECRET}",
    f"https://mlflow.example/#{SECRET}",
    f"https://mlflow.example/#token={SECRET}",
    # Under names no list of secret names knows: any query, any path parameter is refused.
    f"https://mlflow.example/api;token={SECRET}",
    f"https://mlflow.example/;{SECRET}",
    f"https://mlflow.example/?jwt={SECRET}",
    f"https://mlflow.example/?bearer={SECRET}",
    f"https://mlflow.example/?t={SECRET}",
    f"https://mlflow.example/?SAS={SECRET}",
    f"https://mlflow.example/?{SECRET}",
    f"postgresql://db.example/mlflow?pw={SECRET}",
]


@pytest.mark.parametrize("uri", URIS)
def test_a_credential_anywhere_in_the_tracking_uri_is_refused_by_the_config(uri):
    from framework.config.schema import MlflowConfig
    from framework.errors import UserInputError

    with pytest.raises(UserInputError) as refused:
        MlflowConfig(enabled=True, tracking_uri=uri)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("logging.mlflow.tracking_uri")
    assert "MLFLOW_TRACKING_TOKEN" in line and "MLFLOW_TRACKING_PASSWORD" in line
    assert SECRET not in line


@pytest.mark.parametrize(
    "uri", ["http://127.0.0.1:5000", "https://mlflow.example/", "sqlite:///runs/mlflow.db?timeout=20", "databricks"]
)
def test_a_tracking_uri_without_a_credential_is_accepted(uri):
    from framework.config.schema import MlflowConfig

    assert MlflowConfig(enabled=True, tracking_uri=uri).tracking_uri == uri


def test_a_token_in_the_query_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    out = run_main(
        [*TINY, "logger=[mlflow]", f"logging.mlflow.tracking_uri='http://127.0.0.1:5000/?token={SECRET}'"]
        + [f"hydra.run.dir={run}"],
        tmp_path,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and "logging.mlflow.tracking_uri" in errors[0] and "MLFLOW_TRACKING_TOKEN" in errors[0]
    assert SECRET not in out.stdout + out.stderr
    assert not run.exists()  # no config.yaml, no tracker files
