"""Reading DCP checkpoints without running anything stored in them.

torch.distributed.checkpoint keeps its index (`.metadata`) as a pickle and loads it with
`pickle.load`, which runs whatever callable the file names. `SafeFileSystemReader` loads it with
an unpickler that admits only the classes DCP's index is made of and plain containers, and checks
that every shard file the index names is a plain relative path inside the checkpoint (see
[Note: files stay inside] in layout.py). Tensors themselves are read by DCP with
`torch.load(weights_only=True)`, and non-tensor entries are refused by `TensorsOnlyLoadPlanner`.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from framework.checkpoint.layout import CheckpointError, _bad_name

# (module, name) pairs DCP's index pickles. Each is a plain data class, an enum, or a constructor
# of a value (torch.Size, a layout by name, a path), none of which runs code of the file's choice.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype such as torch.float32
        raise CheckpointError(
            f"{self.path} names {module}.{name}, which is not part of a DCP checkpoint "
            "index; it is not loaded (a crafted file can run code when unpickled)"
        )

    def persistent_load(self, pid):
        raise CheckpointError(f"{self.path} holds a persistent reference; it is not a DCP checkpoint index")


def load_metadata(path: str) -> Metadata:
    """DCP's `.metadata` at `path`, through the restricted unpickler."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed pickle is one refusal
            raise CheckpointError(
                f"{path} is not a readable DCP checkpoint index ({type(exc).__name__}: {exc})"
            ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a DCP checkpoint index")
    return metadata


def check_storage(metadata: Metadata, ckpt: str, where: str) -> None:
    """Every shard file the index names is a plain relative path to a regular file inside `ckpt`."""
    root = os.path.realpath(ckpt)
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        why = _bad_name(name)
        path = os.path.join(root, name) if why is None else ""
        if why is None and (os.path.islink(path) or not os.path.realpath(path).startswith(root + os.sep)):
            why = "leads outside the checkpoint"
        if why:
            raise CheckpointError(f"{where} names the shard file {str(name)[:80]!r}, which {why}; it is not read")


def read_checked_metadata(ckpt: str) -> Metadata:
    """The checkpoint's DCP index, loaded safely and with its file names checked."""
    path = os.path.join(ckpt, ".metadata")
    metadata = load_metadata(path)
    check_storage(metadata, ckpt, path)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with the index loaded safely and its file names confined."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = str(self._get_metadata_path(kwargs.get("rank")))
        metadata = load_metadata(path)
        check_storage(metadata, str(self.path), path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
