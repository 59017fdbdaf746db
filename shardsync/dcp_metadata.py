"""A torch.distributed.checkpoint ``.metadata``, read without running it.

Pure: no I/O (torch is imported when a file is parsed, not with this module). The file is a
pickle written by the coordinator of a ``dcp.save``; it is unpickled with an allow-list of
DCP's own classes, so a hostile one cannot run code, and what it names is checked: every
data file's name (never outside its folder) and byte range.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shardsync.errors import ManifestError, UnsafeNameError
from shardsync.manifest import validate_name

__all__ = ["DCP_METADATA", "MAX_METADATA_BYTES", "DCPMetadata", "parse_dcp_metadata"]

DCP_METADATA = ".metadata"

MAX_METADATA_BYTES = 512 << 20
"""Largest ``.metadata`` we unpickle (a very large model's is tens of MiB)."""


@dataclass(frozen=True, slots=True)
class DCPMetadata:
    """What a DCP ``.metadata`` says: the torch ``Metadata`` (for a reader) and, per file of
    the checkpoint folder, the end of the last byte range stored in it."""

    metadata: Any = field(repr=False, compare=False)
    needed: Mapping[str, int]
    folder: str = ""  # where the ``.metadata`` and the files it names are


_DCP_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)


class _DCPUnpickler(pickle.Unpickler):
    """Only the classes a DCP ``Metadata`` is made of (and torch dtypes); anything else, in
    particular any callable that could run code, is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def parse_dcp_metadata(data: bytes, *, path: str = DCP_METADATA) -> DCPMetadata:
    """Unpickle a ``.metadata`` with the allow-list above and check what it names."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if len(data) > MAX_METADATA_BYTES:
        raise ManifestError(f"{path}: larger than {MAX_METADATA_BYTES} bytes")
    try:
        metadata = _DCPUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, KeyError, ...
        raise ManifestError(
            f"{path} is not a torch.distributed.checkpoint metadata file: {exc}"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ManifestError(f"{path} holds a {type(metadata).__name__}, not a DCP Metadata")
    # the allowed classes are built without ``__init__``: a field the file left out is absent
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not isinstance(
        getattr(metadata, "state_dict_metadata", None), dict
    ):
        raise ManifestError(f"{path}: no storage_data / state_dict_metadata mapping")
    needed: dict[str, int] = {}
    for info in storage.values():
        if not isinstance(info, _StorageInfo):
            raise ManifestError(f"{path}: a storage entry is a {type(info).__name__}")
        rel = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str):
            raise ManifestError(f"{path}: a storage entry's file name is not a string")
        try:
            validate_name(rel)
        except UnsafeNameError as exc:
            raise UnsafeNameError(f"{path} names a data file outside its folder: {exc}") from None
        if not all(type(v) is int and v >= 0 for v in (offset, length)):
            raise ManifestError(f"{path}: bad byte range {offset!r}+{length!r} in {rel}")
        assert isinstance(offset, int) and isinstance(length, int)
        needed[rel] = max(needed.get(rel, 0), offset + length)
    return DCPMetadata(metadata=metadata, needed=needed)
