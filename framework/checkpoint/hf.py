"""Hugging Face style safetensors export and import, for any model family with a state-dict
adapter (`framework/models/registry.py`: our names <-> Hugging Face names, and `config.json`).

[Note: streamed export]
Each file is written one tensor at a time: the header (names, dtypes, shapes, offsets) is known
from the sharded state dict's global shapes before any data is gathered, so rank 0 writes it
first; then each parameter is gathered (`DTensor.full_tensor()`, a collective every rank joins),
appended by rank 0 and dropped. No rank ever holds more than one full tensor. Models larger than
`max_shard_bytes` are split into `model-0000i-of-0000N.safetensors` files plus
`model.safetensors.index.json`, the layout `from_pretrained` reads.

[Note: sliced import]
Import needs no communication and never reads a whole tensor it does not keep: every rank opens
the files lazily (`safe_open`) and reads only its own slice of each tensor (`get_slice`), computed
from the DTensor's placements (torch.chunk sizes per mesh dim, left to right), so a model larger
than one rank's memory loads. A tensor transformers stacks from one file tensor per expert
(Mixtral's `experts.3.w1.weight`, Qwen3-MoE's `experts.3.gate_proj.weight`, ...) is read by its
experts: a rank reads only the experts its slice of dim 0 holds (under `parallelism.ep`, its own),
stacks and joins them as transformers does, and keeps its slice of the other dims.
"""

from __future__ import annotations

import json
import os
import struct

import torch

from framework.errors import UserInputError
from framework.fileio import create_temporary, own_directory, read_json, write_json

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained


def _plan_files(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names grouped into files of at most max_shard_bytes (a larger tensor alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if files[-1] and used + nbytes > max_shard_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += nbytes
    return files


def whole_tensor(key: str, t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor (a collective over its mesh), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _write_file(path: str, entries: list[tuple[str, torch.Tensor]], rank: int, gather=whole_tensor) -> None:
    """One safetensors file of (hf name, sharded tensor); every rank joins the gathers
    (`gather(hf name, tensor)`: the whole tensor on rank 0, one at a time)."""
    header, offset = {}, 0
    for key, t in entries:
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    f = None
    if rank == 0:
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        f = create_temporary(path + ".tmp", "wb")  # never through a planted link; closed in the finally below
        f.write(struct.pack("<Q", len(raw)) + raw)
    try:
        for key, t in entries:
            whole = gather(key, t)
            if f is not None:
                f.write(whole.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            del whole
    finally:
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
    if rank == 0:
        os.replace(path + ".tmp", path)


def export_safetensors(
    model_sd: dict[str, torch.Tensor],
    adapter,
    config: dict,
    out_dir: str,
    rank: int,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    gather=None,
) -> str | None:
    """Write `out_dir` as `from_pretrained` reads it: safetensors (one file, or shards plus index)
    and `config.json`. Every rank must call it (the gathers are collectives); see [Note: streamed
    export]. `gather(name, tensor)`: the whole of `model_sd[name]` on rank 0 (default: its
    `full_tensor`; a pipeline's brings other stages' tensors to rank 0). Returns the directory on
    rank 0."""
    entries, ours = [], {}  # ours: hf name -> the state dict's
    for name, t in model_sd.items():
        key = adapter.to_hf(name)
        if key is None or not isinstance(t, torch.Tensor):
            continue
        ours[key] = name
        if t.dtype not in _DTYPES:
            raise NotImplementedError(f"export of {name}: dtype {t.dtype} is not supported")
        entries.append((key, t))
    by_key = dict(entries)
    groups = _plan_files([(k, t.numel() * t.element_size()) for k, t in entries], max_shard_bytes)
    if rank == 0:
        own_directory(out_dir)  # a link planted as the directory is replaced, its target left alone
        for stale in os.listdir(out_dir):  # a previous export's files would confuse from_pretrained
            if stale.endswith(".safetensors") or stale == INDEX_FILE:
                os.remove(os.path.join(out_dir, stale))
    names = (
        [SINGLE_FILE]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    for file_name, keys in zip(names, groups):
        whole = whole_tensor if gather is None else (lambda key, t: gather(ours[key], t))
        _write_file(os.path.join(out_dir, file_name), [(k, by_key[k]) for k in keys], rank, whole)
    if rank != 0:
        return None
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for _, t in entries)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f for f, keys in zip(names, groups) for k in keys},
        }
        write_json(os.path.join(out_dir, INDEX_FILE), index, indent=2)
    write_json(os.path.join(out_dir, "config.json"), config, indent=2)
    return out_dir


# ---------------------------------------------------------------------------------------- import


def weight_files(directory: str, where: str) -> dict[str, str]:
    """{hf tensor name: file path} of a Hugging Face directory (one file or shards + index).
    A file instead of its directory, or a directory above the checkpoint, is refused in one line."""
    if os.path.isfile(directory):
        raise UserInputError(
            f"{where}: this is a file; give the directory that holds it ({os.path.dirname(os.path.abspath(directory))})"
        )
    if not os.path.isdir(directory):
        raise UserInputError(f"{where}: no such directory")
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        index_data = read_json(index)
        weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
        if not isinstance(weight_map, dict):
            raise UserInputError(f"{where}: {index} has no weight_map; give the index save_pretrained wrote")
        outside = [
            v for v in weight_map.values() if not isinstance(v, str) or os.path.basename(v) != v or v in ("", ".", "..")
        ]
        if outside:  # shards are read from this directory only (see [Note: files stay inside])
            raise UserInputError(
                f"{where}: {INDEX_FILE} names {str(outside[0])[:80]!r}, which is not a file "
                "beside it; shards are read only from the checkpoint's own directory"
            )
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(directory, v))})
        if missing:
            raise UserInputError(
                f"{where}: {INDEX_FILE} names {missing[0]} ({len(missing)} file(s) missing); "
                "copy the whole checkpoint directory"
            )
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        with open_safetensors(single, where) as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 - a safe_open handle is not iterable
    below = sorted(
        d
        for d in os.listdir(directory)
        if os.path.isfile(os.path.join(directory, d, SINGLE_FILE))
        or os.path.isfile(os.path.join(directory, d, INDEX_FILE))
    )
    if below:
        raise UserInputError(
            f"{where}: no {SINGLE_FILE} here, but {os.path.join(directory, below[0])} holds one; give that directory"
        )
    raise UserInputError(
        f"{where}: no {SINGLE_FILE} or {INDEX_FILE} in this directory; give a directory "
        "written by checkpoint.export_safetensors or transformers' save_pretrained"
    )


def read_config(directory: str) -> dict | None:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    return read_json(path)


def open_safetensors(path: str, where: str):
    """`safe_open(path)`; a file whose header does not describe its bytes (dtypes, shapes or
    offsets that do not fit, a truncated file) is one refusal naming it."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type from Rust
        raise UserInputError(f"{where}: {path} is not a readable safetensors file ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


def _local_box(like: torch.Tensor) -> list[tuple[int, int]] | None:
    """[(start, stop)] per dim of this rank's piece of the DTensor `like` (None: unsupported
    placements, read whole and cut). torch.chunk sizes per mesh dim, applied left to right."""
    from torch.distributed.tensor import Replicate, Shard

    box = [(0, n) for n in like.shape]
    coordinate = like.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    for mesh_dim, placement in enumerate(like.placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim, parts = placement.dim % like.dim(), like.device_mesh.size(mesh_dim)
        lo, hi = box[dim]
        chunk = -(-(hi - lo) // parts)
        start = min(lo + coordinate[mesh_dim] * chunk, hi)
        box[dim] = (start, min(start + chunk, hi))
    return box


def _read_piece(handle, key: str, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of tensor `key`, laid out like `like` (see [Note: sliced import])."""
    if not hasattr(like, "device_mesh"):
        return handle.get_tensor(key).to(like.dtype)

    box = _local_box(like) if like.dim() else None
    if box is None:
        return _from_full(handle.get_tensor(key).to(like.dtype), like)
    if any(hi <= lo for lo, hi in box):
        local = torch.empty([hi - lo for lo, hi in box], dtype=like.dtype)
    else:
        local = handle.get_slice(key)[tuple(slice(lo, hi) for lo, hi in box)].to(like.dtype)
    return _like(local, like)


def import_safetensors(
    directory: str,
    model_sd: dict[str, torch.Tensor],
    adapter,
    where: str,
    used_elsewhere=None,
) -> tuple[dict[str, torch.Tensor], int]:
    """A state dict shaped like `model_sd` (sharded) with values read from `directory`; every
    tensor of the files must be used. `where` names the config field in messages.
    `used_elsewhere(keys) -> keys`: a pipeline's (parallelism.pp) file keys used by any rank, given
    this rank's (collective): a rank holds its stages only, the job the whole model."""
    files = weight_files(directory, where)
    renamed, merged = adapter.converted_names(sorted(files), where) if hasattr(adapter, "converted_names") else ({}, {})
    plan: dict[str, str] = {}  # our name -> hf name
    merges: dict[str, tuple] = {}  # our name -> (operations, [[hf names] per source pattern])
    for name, like in model_sd.items():
        if not isinstance(like, torch.Tensor):
            continue
        key = adapter.to_hf(name)
        if key is not None and key not in files and key in merged:
            merges[name] = merged[key]
            continue
        if key is not None and key not in files and key in renamed:
            key = renamed[key]  # what save_pretrained wrote under its legacy name
        if key is None or key not in files:
            fallback = adapter.from_hf_fallback(name)
            key = fallback if fallback in files else key
        if key is None or key not in files:
            raise UserInputError(
                f"{where}: the checkpoint has no tensor {key or name} (our {name}); it is "
                "not a checkpoint of this model"
            )
        plan[name] = key
    ignorable = getattr(adapter, "ignorable", lambda key: False)
    used = set(plan.values()) | {k for _, groups in merges.values() for group in groups for k in group}
    if used_elsewhere is not None:
        used = used_elsewhere(used)
    unused = sorted(k for k in set(files) - used if not ignorable(k))
    if unused:
        raise UserInputError(
            f"{where}: the checkpoint holds {len(unused)} tensor(s) this model does not use "
            f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); it computes "
            "differently from the configured model"
        )
    out: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for name, key in plan.items():
        by_file.setdefault(files[key], []).append(name)
    for path, names in by_file.items():
        with open_safetensors(path, where) as f:
            for name in names:
                key, like = plan[name], model_sd[name]
                try:
                    shape = tuple(f.get_slice(key).get_shape())
                    if shape != tuple(like.shape):
                        raise UserInputError(f"{where}: {key} has shape {shape}, the model needs {tuple(like.shape)}")
                    out[name] = _read_piece(f, key, like)
                except UserInputError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a lying header shows when the bytes are read
                    raise UserInputError(f"{where}: {path}: tensor {key} cannot be read ({_first_line(exc)})") from None
    for name, (operations, groups) in merges.items():
        like = model_sd[name]
        box = _expert_box(like, operations, groups)
        if box is not None:  # this rank's experts only (see [Note: sliced import])
            out[name] = _merged_piece(files, operations, groups, where, like, box, name)
            continue
        full = _merge(files, operations, groups, where)
        if tuple(full.shape) != tuple(like.shape):
            raise UserInputError(
                f"{where}: {groups[0][0]} and the tensors merged with it make shape {tuple(full.shape)}, "
                f"the model needs {tuple(like.shape)} (our {name})"
            )
        out[name] = _from_full(full.to(like.dtype), like)
    return out, len(out)


def _expert_box(like: torch.Tensor, operations, groups: list[list[str]]):
    """This rank's box of a tensor stacked per expert on dim 0 (MergeModulelist(0), then joins on
    other dims) from one file tensor per expert; None when the merge is another or `like` whole."""
    kinds = [(type(op).__name__, getattr(op, "dim", 0)) for op in operations]
    stacked = bool(kinds) and kinds[0] == ("MergeModulelist", 0) and all(d != 0 for _, d in kinds[1:])
    if not stacked or not hasattr(like, "device_mesh") or any(len(g) != like.shape[0] for g in groups):
        return None
    return _local_box(like)


def _merged_piece(files, operations, groups, where: str, like: torch.Tensor, box, name: str) -> torch.Tensor:
    """The piece `box` of a per-expert merge, reading only the experts in box[0]."""

    lo, hi = box[0]
    part = _merge(files, operations, [g[lo:hi] for g in groups], where) if hi > lo else None
    if part is None:  # no expert here (more ranks than experts on this dim): an empty piece
        local = torch.empty([b - a for a, b in box], dtype=like.dtype)
    else:
        if tuple(part.shape[1:]) != tuple(like.shape[1:]):
            raise UserInputError(
                f"{where}: {groups[0][0]} and the tensors merged with it make shape "
                f"{(like.shape[0], *part.shape[1:])}, the model needs {tuple(like.shape)} (our {name})"
            )
        local = part[(slice(None), *(slice(a, b) for a, b in box[1:]))].to(like.dtype).contiguous()
    return _like(local, like)


def _like(local: torch.Tensor, like) -> torch.Tensor:
    """`local` as this rank's piece of a DTensor laid out as `like`."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(like.device_mesh.device_type),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _merge(files: dict[str, str], operations, groups: list[list[str]], where: str) -> torch.Tensor:
    """What transformers builds on load from per-expert tensors (see [Note: what save_pretrained
    writes]): each source pattern's tensors stacked (MergeModulelist), then the patterns joined
    (Concatenate)."""

    def read(key: str) -> torch.Tensor:
        with open_safetensors(files[key], where) as f:
            try:
                return f.get_tensor(key)
            except Exception as exc:  # noqa: BLE001 - as in import_safetensors
                raise UserInputError(
                    f"{where}: {files[key]}: tensor {key} cannot be read ({_first_line(exc)})"
                ) from None

    parts = [[read(k) for k in group] for group in groups]
    for op in operations:
        kind, dim = type(op).__name__, getattr(op, "dim", 0)
        if kind == "MergeModulelist":
            parts = [torch.stack(group, dim=dim) if isinstance(group, list) else group for group in parts]
        elif kind == "Concatenate":
            parts = [torch.cat(parts, dim=dim)]
        else:
            raise UserInputError(
                f"{where}: transformers builds {groups[0][0]} and others with {kind}, which this framework "
                "does not read yet; save the model with its state-dict names (model.state_dict() to safetensors)"
            )
    if len(parts) != 1 or isinstance(parts[0], list):
        raise UserInputError(f"{where}: cannot merge {groups[0][0]} and the tensors beside it into one")
    return parts[0]


def _from_full(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `like` (this rank's piece of a DTensor). src_data_rank=None: every rank
    already has the full tensor; cut locally, communicate nothing."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
