"""What goes into a checkpoint, and getting it out of / back into a running job.

Model and optimizer state are sharded DTensor state dicts in the format of
`torch.distributed.checkpoint.state_dict.get_state_dict` (fully-qualified parameter names), for
either engine, so DCP can reshard them on load: a checkpoint saved on 2 ranks loads on 1 or 4,
and one saved by the torch engine loads into the native engine and back (each engine's
`get_state_dicts`/`set_state_dicts`, framework/distributed/engines.py). This module holds what
else a checkpoint carries: the optimizer's param groups as JSON, the RNG states, and the loader
that refuses anything pickled.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
from typing import Any, Dict, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from framework.fileio import create_temporary


class TensorsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor entries with `weights_only=False`, which can run
    code stored in a file. We keep every non-tensor value out of DCP (it goes to JSON), so a
    pickled entry in the shards means the files are not ours: refuse it."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raise ValueError(
            f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; this "
            "framework writes tensors only and does not unpickle checkpoint data"
        )


def split_optim(optim_sd: Dict[str, Any]) -> Tuple[Dict[str, Any], list]:
    """(tensor state for DCP, param_groups as plain JSON data)."""
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd.get("param_groups", [])
    ]
    return {"state": optim_sd.get("state", {})}, groups


def join_optim(tensors: Dict[str, Any], groups: list) -> Dict[str, Any]:
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": tensors["state"], "param_groups": groups}


def dcp_load(state: Dict[str, Any], path: str) -> None:
    """Load sharded tensors into `state` in place, resharding to this job's layout. DCP's failure
    (a BaseException carrying every rank's traceback) becomes one line: the first rank's error."""
    from framework.checkpoint.layout import CheckpointError
    from framework.checkpoint.safe_reader import SafeFileSystemReader, read_checked_metadata

    read_checked_metadata(path)  # refused here, in one line, before DCP reads anything
    try:
        dcp.load(
            state, checkpoint_id=path, planner=TensorsOnlyLoadPlanner(), storage_reader=SafeFileSystemReader(path)
        )  # no unpickling of .metadata
    except dcp.CheckpointException as exc:
        errors = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        first = next((str(e).strip().splitlines()[0] for e in errors if str(e).strip()), "unknown error")
        raise CheckpointError(f"{path} cannot be loaded into this job: {first}") from None


# ---- RNG: every rank's generators, as JSON (no pickle) ----


def _bytes(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    out = {"python": [version, list(internal), gauss], "torch": _bytes(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [_tensor(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def rng_path(ckpt: str, rank: int) -> str:
    return os.path.join(ckpt, "rng", f"rank_{rank:05d}.json")


def write_rng(ckpt: str, rank: int) -> str:
    path = rng_path(ckpt, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with create_temporary(path) as f:  # inside the save's fresh temp directory; never through a link
        json.dump(rng_state(), f)
        f.flush()
        os.fsync(f.fileno())
    return path


_SMALL_FILE = 16 << 20  # bytes: train_state.json and an RNG file are a few KB


def read_rng(ckpt: str, rank: int) -> dict:
    """This rank's RNG states; a rank the saving job did not have takes rank 0's (resume at a
    larger world size), so its streams are defined, though not those of any earlier rank. States
    that the generators would not take are refused (CheckpointError) before any is set."""
    from framework.checkpoint.layout import CheckpointError, read_small_json

    path = rng_path(ckpt, rank)
    if not os.path.lexists(path):
        path = rng_path(ckpt, 0)
    bad = "it does not hold the RNG states a save writes; resume from another checkpoint"
    state = read_small_json(path, _SMALL_FILE, bad)
    try:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))  # a throwaway generator: only checks
        torch.Generator().set_state(_tensor(state["torch"]))
        if "cuda" in state and not (isinstance(state["cuda"], list) and all(isinstance(s, str) for s in state["cuda"])):
            raise TypeError
    except Exception:  # noqa: BLE001 - any malformed state is the same refusal
        raise CheckpointError(f"{path}: {bad}") from None
    return state


def read_train_state(ckpt: str) -> dict:
    """train_state.json, with every field a save writes present and of its type (CheckpointError
    naming the file otherwise)."""
    from framework.checkpoint.layout import TRAIN_STATE, CheckpointError, read_small_json

    path = os.path.join(ckpt, TRAIN_STATE)
    fix = "resume from another checkpoint"
    saved = read_small_json(path, _SMALL_FILE, fix)
    shapes = {"step": int, "scheduler": dict, "train_loader": dict, "optimizer_param_groups": list}
    for key, kind in shapes.items():
        value = saved.get(key) if isinstance(saved, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{path}: '{key}' is missing or not a {kind.__name__}; {fix}")
    consumed = saved["train_loader"].get("consumed_samples")
    if saved["step"] < 0 or not isinstance(consumed, int) or consumed < 0:
        raise CheckpointError(f"{path}: 'step' or 'train_loader.consumed_samples' is not a count; {fix}")
    if not all(isinstance(g, dict) for g in saved["optimizer_param_groups"]):
        raise CheckpointError(f"{path}: 'optimizer_param_groups' is not a list of objects; {fix}")
    return saved
