"""Where checkpoints live on disk, how one becomes visible atomically, and how one is verified.

    <checkpoint.dir>/
      step_00000012/            one complete checkpoint
        __0_0.distcp ...        DCP shards, written by every rank in parallel
        .metadata               DCP's index of the shards (rank 0)
        train_state.json        step, LR scheduler, data-loader position (rank 0)
        rng/rank_00000.json     every rank's RNG states
        manifest.json           written last: config, world layout, versions, git, per-file sha256
      step_00000024.tmp-<id>/   a save in progress (or one killed mid-way): never loaded
      latest                    the name of the newest complete checkpoint, replaced atomically

[Note: atomic checkpoints]
A save writes everything into `step_N.tmp-<id>`, fsyncs it, writes the manifest last, renames the
directory to `step_N` (an atomic rename on POSIX file systems) and only then replaces `latest`
(write `latest.tmp`, fsync, `os.replace`). A process killed at any point therefore leaves either
the previous checkpoint as `latest`, or the new one complete: never a half-written one that
`resume=auto` would pick. Leftover `.tmp-` directories are deleted by the next successful save.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Dict, List, Optional, Sequence

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which one to use instead."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str) -> Optional[int]:
    match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def sha256_of(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def files_of(ckpt: str) -> List[str]:
    """Every file of a checkpoint that the manifest covers (relative paths), sorted."""
    out = []
    for root, _, names in os.walk(ckpt):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), ckpt)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def commit(tmp_dir: str, final_dir: str, manifest: dict) -> None:
    """Rank 0, after every rank has written and fsynced its files: manifest, rename, `latest`.
    See [Note: atomic checkpoints]."""
    write_json_atomic(os.path.join(tmp_dir, MANIFEST), manifest)
    fsync_dir(tmp_dir)
    if os.path.exists(final_dir):  # a previous run saved this very step; the new one replaces it
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    parent = os.path.dirname(final_dir)
    fsync_dir(parent)
    pointer = os.path.join(parent, LATEST)
    with open(pointer + ".tmp", "w") as f:
        f.write(os.path.basename(final_dir) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer + ".tmp", pointer)
    fsync_dir(parent)


def complete_checkpoints(root: str) -> List[str]:
    """Committed checkpoints under `root` (those with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if step_of(name) is not None and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append(path)
    return sorted(found, key=lambda p: step_of(p))


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint `latest` names, or the newest committed one if the pointer is missing."""
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(root, f.read().strip())
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return path
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` committed checkpoints, and leftover temp directories
    of saves that never finished (rank 0, right after a commit, when no save is in flight)."""
    for path in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        if ".tmp-" in name and step_of(name.split(".tmp-")[0]) is not None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_manifest(ckpt: str) -> dict:
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt} has no {MANIFEST}: it is not a complete checkpoint "
                              "(a save that did not finish); resume from an earlier one")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{ckpt}: checkpoint format {manifest.get('format')} is not "
                              f"{FORMAT_VERSION}, the one this version reads")
    return manifest


def verify_files(ckpt: str, expected: Dict[str, dict], names: Sequence[str]) -> List[str]:
    """Problems with `names` (a subset of the manifest's files): missing, wrong size, wrong sha256."""
    problems = []
    for name in names:
        path = os.path.join(ckpt, name)
        want = expected[name]
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != want["bytes"]:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']}")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest")
    return problems


def integrity_message(ckpt: str, problems: List[str], find_good: bool = True) -> str:
    """The one-line refusal of a corrupted checkpoint, naming the newest earlier checkpoint that
    passes the same check (`find_good`: verify them, on the one rank that prints the message)."""
    root = os.path.dirname(os.path.abspath(ckpt))
    older = [p for p in complete_checkpoints(root) if step_of(p) < (step_of(ckpt) or 0)]
    good = None
    for candidate in reversed(older if find_good else []):
        try:
            files = read_manifest(candidate)["files"]
        except (CheckpointError, ValueError):
            continue
        if not verify_files(candidate, files, sorted(files)):
            good = candidate
            break
    hint = (f"resume from the previous good checkpoint with checkpoint.resume={good}" if good
            else "no earlier checkpoint there passes the check; start with checkpoint.resume=none")
    return f"checkpoint {ckpt} failed its integrity check ({'; '.join(problems[:3])}); {hint}"
