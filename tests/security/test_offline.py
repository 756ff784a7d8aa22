"""Nothing downloads, whatever the environment says. With HF_HUB_OFFLINE=0 (and its siblings)
exported and the network blocked (tests/security/no_network: resolving a name or connecting to an
address that is not loopback is recorded, then fails), a hub dataset name, a hub model name and a
built-in lm-eval task whose data is on the hub are each refused in one line, and no connection was
attempted: the job put Hugging Face's libraries offline itself, including the ones imported before
it started (the tests' fork server has transformers imported, as a user's process may)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, pinned_import, run_main

pinned_import("lm_eval")
pinned_import("datasets")

NO_NETWORK = Path(__file__).resolve().parent / "no_network"
ONLINE = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}


def _blocked_env(log: Path) -> dict:
    return {"PYTHONPATH": f"{NO_NETWORK}{os.pathsep}{REPO}", "FRAMEWORK_TEST_NETWORK_LOG": str(log), **ONLINE}


def test_the_network_block_records_what_it_stops(tmp_path):
    """The guard the other tests rely on: an attempt is recorded and fails."""
    log = tmp_path / "network.log"
    code = "import socket\ntry:\n    socket.create_connection(('huggingface.co', 443), 5)\nexcept OSError:\n    pass"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **_blocked_env(log)}, timeout=60)
    assert out.returncode == 0
    assert "huggingface.co" in log.read_text()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from framework.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("offline")
    rnd = random.Random(0)
    words = "a job that reads no hub trains on what this machine holds".split()
    docs = [" ".join(rnd.choice(words) for _ in range(rnd.randint(10, 40))) for _ in range(200)]
    pq.write_table(pa.table({"text": docs}), root / "corpus.parquet")
    train_bpe(docs, 300, str(root / "tok.json"))
    return root


def _local_data(root: Path) -> list:
    return ["data=hf", f"data.paths=[{root}/corpus.parquet]", f"data.tokenizer={root}/tok.json", "data.seq_len=32"]


CASES = {
    "hub dataset": (
        lambda root: ["data=hf", "data.paths=[allenai/c4]", f"data.tokenizer={root}/tok.json"],
        "allenai/c4",
    ),
    "hub model": (lambda root: ["model=hf", "model.path=openai-community/gpt2"], "openai-community/gpt2"),
    # a built-in lm-eval task whose data is on the hub (allenai/ai2_arc), run at the end of training
    "lm-eval task": (lambda root: [*_local_data(root), "trainer.eval_tasks=[arc_easy]"], "arc_easy"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hub_name_is_refused_without_a_connection_whatever_the_environment_says(corpus, tmp_path, case):
    overrides, name = CASES[case]
    log = tmp_path / "network.log"
    run = tmp_path / "run"
    out = run_main(
        [*TINY, *overrides(corpus), "trainer.max_steps=1", "cluster.nproc_per_node=1", f"hydra.run.dir={run}"],
        tmp_path,
        env=_blocked_env(log),
        timeout=240,
    )
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(errors) == 1 and name in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not log.exists(), log.read_text()  # no name resolved, no connection tried
