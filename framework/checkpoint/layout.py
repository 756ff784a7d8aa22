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

[Note: files stay inside]
A checkpoint may come from elsewhere, so nothing in it may lead the reader outside it: `latest`
must hold a plain `step_N` name, every manifest entry and every file DCP's index names must be a
plain relative path to a regular file (no `..`, no absolute path, no symlink) inside the
checkpoint, and the manifest must list every file there (an unlisted file would be read
unchecked). A path is refused before it is opened or its size looked at, so a refusal never says
anything about a file outside. Nothing read is executed: tensors go through
`torch.load(weights_only=True)`, DCP's `.metadata` through a restricted unpickler
(framework/checkpoint/safe_reader.py), everything else is JSON.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from typing import Dict, List, Optional, Sequence

from framework.fileio import create_temporary

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
FORMAT_VERSION = 1
_MANIFEST_LIMIT = 64 << 20  # bytes of a manifest read at most (a real one is a few KB per 100 files)
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
    with create_temporary(tmp) as f:  # never through a link planted under the temporary name
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
    parent = os.path.dirname(final_dir)
    manifest = {**manifest, "commit": 1 + max((commit_number(p) for p in complete_checkpoints(parent)), default=0)}
    write_json_atomic(os.path.join(tmp_dir, MANIFEST), manifest)
    fsync_dir(tmp_dir)
    if os.path.exists(final_dir):  # a previous run saved this very step; the new one replaces it
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(parent)
    pointer = os.path.join(parent, LATEST)
    with create_temporary(pointer + ".tmp") as f:
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


def commit_number(ckpt: str) -> int:
    """The order in which `ckpt` was committed among the checkpoints of its directory (see
    [Note: commit order]); 0 for a checkpoint written before commits were numbered, or unreadable."""
    try:
        number = read_small_json(os.path.join(ckpt, MANIFEST), _MANIFEST_LIMIT, "").get("commit", 0)
    except (CheckpointError, AttributeError):
        return 0
    return number if isinstance(number, int) and not isinstance(number, bool) and number > 0 else 0


def in_commit_order(root: str) -> List[str]:
    """Committed checkpoints under `root`, oldest commit first (ties, and checkpoints from before
    commits were numbered, by step)."""
    return sorted(complete_checkpoints(root), key=lambda p: (commit_number(p), step_of(p)))


def latest_checkpoint(root: str) -> Optional[str]:
    """The checkpoint `latest` names, or the last committed one if the pointer is missing.
    `latest` must be a regular file holding a plain `step_N` name inside `root` (see
    [Note: files stay inside]); anything else is refused without quoting it."""
    pointer = os.path.join(root, LATEST)
    if os.path.lexists(pointer):
        name = _read_pointer(pointer)
        path = os.path.join(root, name)
        if os.path.isfile(os.path.join(path, MANIFEST)):
            check_inside(root, path, what=pointer)
            return path
    found = in_commit_order(root)
    if found:
        check_inside(root, found[-1], what=found[-1])
    return found[-1] if found else None


def _read_pointer(pointer: str) -> str:
    """The `step_N` name `latest` holds. A symlink, a special file or any other content is
    refused in one line that quotes nothing from it (it may be any file of the machine)."""
    fix = (
        "delete it (resume=auto then takes the last committed checkpoint) or name a checkpoint "
        "with checkpoint.resume=<path>"
    )
    raw = read_bounded(pointer, 64, f"it is not the pointer a save writes; {fix}")
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        name = ""
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} does not hold the name of a step_N directory beside it; {fix}")
    return name


# [Note: commit order]
# Every manifest carries `commit`: one more than the largest among the checkpoints already in its
# directory when it was committed. Pruning keeps the newest *commits*, not the highest step numbers:
# a run resumed from an earlier checkpoint (a rollback past a divergence) saves steps lower than
# those of the run it abandoned, and must never see its own new saves deleted in favour of the
# abandoned ones (which `latest` no longer names). The abandoned run's checkpoints are the oldest
# commits, so they go first; `latest` always names the last commit.


def prune(root: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` commits (see [Note: commit order]), and leftover temp
    directories of saves that never finished (rank 0, right after a commit, when no save is in
    flight)."""
    for path in in_commit_order(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for name in os.listdir(root):
        if ".tmp-" in name and step_of(name.split(".tmp-")[0]) is not None:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def check_inside(root: str, path: str, what: str) -> None:
    """Refuse `path` unless it resolves (symlinks followed) to a place inside `root`."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise CheckpointError(
            f"{what} leads outside {root} (to {path}, a symlink or '..'); a checkpoint "
            "is only read from inside its own directory: remove the link"
        )


def _bad_name(name) -> Optional[str]:
    """Why `name` (a path from a manifest or DCP's index) is not a plain relative path, or None."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    parts = name.split("/")
    if name.startswith(("/", "\\")) or "\\" in name or any(p in ("", ".", "..") for p in parts):
        return "is not a plain relative path inside the checkpoint"
    return None


def read_small_json(path: str, limit: int, consequence: str):
    """The JSON in the regular file `path` (no symlink, at most `limit` bytes), or one
    CheckpointError naming the file and quoting nothing from it."""
    raw = read_bounded(path, limit, consequence)
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path} is not JSON; {consequence}") from None


def read_bounded(path: str, limit: int, consequence: str) -> bytes:
    """The bytes of the regular file `path` (no symlink, no FIFO or device, at most `limit`
    bytes), or one CheckpointError naming the file and quoting nothing from it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        what = "a symlink" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
        raise CheckpointError(f"{path} is {what}; {consequence}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not a regular file; {consequence}")
        if info.st_size > limit:
            raise CheckpointError(f"{path} has {info.st_size} bytes, more than the {limit} expected; {consequence}")
        return f.read(limit + 1)


def read_manifest(ckpt: str) -> dict:
    """The manifest, checked for form: JSON, this format, and a `files` table that names each file
    with its sha256 and size, every name a plain relative path. See [Note: files stay inside]."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{ckpt} has no {MANIFEST}: it is not a complete checkpoint "
            "(a save that did not finish); resume from an earlier one"
        )
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symlink; a checkpoint's files must be its own")
    manifest = read_small_json(path, _MANIFEST_LIMIT, "the checkpoint cannot be verified")
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a JSON object; the checkpoint cannot be verified")
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt}: checkpoint format {manifest.get('format')} is not {FORMAT_VERSION}, the one this version reads"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(
            f"{path} lists no files (`files` is {'missing' if files is None else repr(files)[:40]}): "
            "a manifest must vouch for every file of its checkpoint"
        )
    for name, entry in files.items():
        why = _bad_name(name)
        if why is None and not (
            isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
        ):
            why = "has no sha256 and size"
        if why:
            raise CheckpointError(f"{path}: the entry {name!r:.80} {why}")
    return manifest


def verify_files(ckpt: str, expected: Dict[str, dict], names: Sequence[str]) -> List[str]:
    """Problems with `names` (a subset of the manifest's files): outside the checkpoint, not a
    regular file, missing, wrong size, wrong sha256. Nothing is read, or its size reported, before
    the path is known to be a regular file inside `ckpt`."""
    problems = []
    for name in names:
        path = os.path.join(ckpt, name)
        want = expected[name]
        why = _bad_name(name)
        if why:
            problems.append(f"the entry {name!r:.80} {why}")
            continue
        real_ckpt = os.path.realpath(ckpt)
        if os.path.islink(path) or not os.path.realpath(path).startswith(real_ckpt + os.sep):
            problems.append(f"{name} is a symlink or leads outside the checkpoint")
        elif not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != want["bytes"]:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, the manifest says {want['bytes']}")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest")
    return problems


def unlisted_files(ckpt: str, expected: Dict[str, dict]) -> List[str]:
    """Files in the checkpoint that its manifest does not vouch for (they would be read unchecked)."""
    return [f"{name} is not listed in the manifest" for name in files_of(ckpt) if name not in expected]


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
    hint = (
        f"resume from the previous good checkpoint with checkpoint.resume={good}"
        if good
        else "no earlier checkpoint there passes the check; start with checkpoint.resume=none"
    )
    return f"checkpoint {ckpt} failed its integrity check ({'; '.join(problems[:3])}); {hint}"
