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


# [Note: bounded unpickling]
# The allow-list decides *what* a pickle may build; a file built only of tuples and dicts can
# still hang or crash the reader by *how* it is built: a tuple of a tuple of ... 60 levels deep,
# each level the same object twice (pickle's memo makes that a few hundred bytes), takes 2^60
# steps to hash as a dict key; a tuple nested 10^6 deep overflows the C stack when hashed or
# compared. So before anything is built, `check_shape` walks the opcodes (pickletools.genops,
# nothing constructed) and follows the stack: every value gets its nesting depth and the number
# of values it holds *counting shared ones as often as they are reached* (the work hashing,
# comparing or walking it costs). A file over MAX_METADATA_BYTES, a value nested deeper than
# MAX_DEPTH, a total over MAX_NODES (+ 8 per opcode), or a container changed after it was put
# inside another (how cycles and late-grown depth are built; DCP's index has neither) is refused.
# DCP's own index is ~10 levels deep and holds each value about once.
MAX_METADATA_BYTES = 1 << 30
MAX_DEPTH = 64
MAX_NODES = 1 << 22


class _Node:
    __slots__ = ("depth", "size", "used")

    def __init__(self, children=()):
        self.depth = 1 + max((c.depth for c in children), default=0)
        self.size = 1 + sum(c.size for c in children)
        self.used = False


_MARK = object()
_SAME = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD", "READONLY_BUFFER"}


def check_shape(data: bytes, path: str) -> None:
    """Refuse a pickle that would take unbounded work or stack to build (see [Note: bounded
    unpickling]); builds nothing."""
    import pickletools

    stack, memo, ops = [], {}, 0
    limit = MAX_NODES + 8 * len(data)

    def refuse(why: str):
        return CheckpointError(f"{path} {why}; it is not an index a save wrote, and is not loaded")

    def pop():
        if not stack or stack[-1] is _MARK:
            raise refuse("is not a well-formed pickle")
        return stack.pop()

    try:
        for op, arg, _ in pickletools.genops(data):
            ops += 1
            name, before = op.name, op.stack_before
            if name == "MARK":
                stack.append(_MARK)
                continue
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
                continue
            if name in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
                continue
            if name == "DUP":
                stack.append(stack[-1])
                continue
            children = []
            if pickletools.markobject in before:
                while stack and stack[-1] is not _MARK:
                    children.append(stack.pop())
                if not stack:
                    raise refuse("is not a well-formed pickle")
                stack.pop()
                children += [pop() for _ in range(before.index(pickletools.markobject))]
            else:
                children = [pop() for _ in before]
            if name == "MEMOIZE":
                memo[len(memo)] = children[0]
                stack.append(children[0])
                continue
            if name in _SAME:  # the container (deepest on the stack) is changed in place
                node, added = children[-1], children[:-1]
                if node.used:
                    raise refuse("changes a value after putting it inside another (a cycle, or depth grown late)")
                node.depth = max(node.depth, 1 + max((c.depth for c in added), default=0))
                node.size += sum(c.size for c in added)
            else:
                node = _Node(children)
            for child in children:
                if child is not node:
                    child.used = True
            if node.depth > MAX_DEPTH:
                raise refuse(f"nests values more than {MAX_DEPTH} deep")
            if node.size > limit:
                raise refuse(f"holds more than {limit} values when shared ones are counted (work to hash or walk)")
            if op.stack_after:
                stack.append(node)
    except CheckpointError:
        raise
    except Exception:  # noqa: BLE001 - a malformed opcode stream is one refusal
        raise refuse("is not a well-formed pickle") from None


def load_metadata(path: str) -> Metadata:
    """DCP's `.metadata` at `path`, through the restricted unpickler, once its size and shape
    are known to be bounded (see [Note: bounded unpickling])."""
    import io

    from framework.checkpoint.layout import read_bounded

    data = read_bounded(path, MAX_METADATA_BYTES, "it is not loaded")
    check_shape(data, path)
    with io.BytesIO(data) as f:
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
    """Every shard file the index names is a plain relative path to a regular file inside `ckpt`,
    every stored piece lies within that file, and every piece of a tensor lies within the tensor,
    the pieces adding up to the tensor's size (see [Note: an index that lies])."""
    root = os.path.realpath(ckpt)
    sizes = {}
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        why = _bad_name(name)
        path = os.path.join(root, name) if why is None else ""
        if why is None and (os.path.islink(path) or not os.path.realpath(path).startswith(root + os.sep)):
            why = "leads outside the checkpoint"
        if why is None and not os.path.isfile(path):
            why = "is missing"
        if why:
            raise CheckpointError(f"{where} names the shard file {str(name)[:80]!r}, which {why}; it is not read")
        if name not in sizes:
            sizes[name] = os.path.getsize(path)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (_count(offset) and _count(length) and offset + length <= sizes[name]):
            raise CheckpointError(
                f"{where}: the piece of {_fqn(index)} is said to lie at bytes {_num(offset)}+{_num(length)} of "
                f"{name}, which has {sizes[name]} bytes; the index does not match its files, and is not loaded"
            )
    for fqn, entry in (metadata.state_dict_metadata or {}).items():
        shape = getattr(entry, "size", None)
        if shape is None:
            continue  # a non-tensor entry: refused by the load planner if this job asks for it
        if not all(_count(n) for n in shape):
            raise CheckpointError(f"{where}: {str(fqn)[:80]} has the impossible shape {_num(shape)}; it is not loaded")
        volume = 0
        for chunk in getattr(entry, "chunks", None) or ():
            offsets, extent = tuple(chunk.offsets), tuple(chunk.sizes)
            inside = len(offsets) == len(extent) == len(shape) and all(
                _count(o) and _count(n) and o + n <= dim for o, n, dim in zip(offsets, extent, shape)
            )
            if not inside:
                raise CheckpointError(
                    f"{where}: a piece of {str(fqn)[:80]} (offsets {_num(offsets)}, sizes {_num(extent)}) lies "
                    f"outside the tensor's shape {tuple(shape)}; the index does not fit its files, and is not loaded"
                )
            n = 1
            for d in extent:
                n *= d
            volume += n
        total = 1
        for d in shape:
            total *= d
        if volume != total:
            raise CheckpointError(
                f"{where}: the pieces of {str(fqn)[:80]} hold {volume} elements, its shape {tuple(shape)} "
                f"{total}; the index does not fit its files, and is not loaded"
            )


# [Note: an index that lies]
# A checkpoint's manifest can be re-hashed by whoever changed its files, so the index is checked
# against itself and the files: a piece claiming more than its tensor (DCP would narrow it
# silently and load wrong weights), pieces that do not add up to the tensor, or a byte range past
# the end of its shard file (a riddle deep inside the reader) is refused before anything is read.
# What a consistent index with wrong numbers in its tensors loads cannot be told from training:
# see docs/reliability.md on trusting a checkpoint.


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _num(value) -> str:
    return str(value)[:40]


def _fqn(index) -> str:
    return str(getattr(index, "fqn", index))[:80]


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
