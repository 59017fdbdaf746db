"""What the fake hub stores: repositories, their commits and files, and the bytes behind them.

A file is held in memory or read from disk in place (a checkpoint of gigabytes is never
copied); its LFS metadata, git blob id and the tree and sibling entries the Hub API shows are
computed here, so the HTTP side (``fakehub``) only answers.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "LFS_SUFFIXES",
    "LFS_THRESHOLD",
    "Blob",
    "Commit",
    "MemoryBlob",
    "Repo",
    "RepoFile",
    "content_commit",
    "make_file",
    "sibling",
]

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
"""Files with these suffixes are stored in LFS (served through the CDN) whatever their size."""

LFS_THRESHOLD = 10 * 1024 * 1024
"""Files larger than this are stored in LFS too."""


class Blob(Protocol):
    """The bytes of one file, wherever they live."""

    @property
    def size(self) -> int:
        """Length in bytes."""

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Exactly `length` bytes from `offset`."""

    def close(self) -> None:
        """Release whatever reading needed."""


class MemoryBlob:
    """Bytes held in memory; reads are zero-copy views."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)

    @property
    def size(self) -> int:
        return len(self._data)

    def read(self, offset: int, length: int) -> memoryview:
        return self._data[offset : offset + length]

    def close(self) -> None:
        """Nothing to release."""


class FileBlob:
    """A file on disk, read with ``pread`` so a multi-GB checkpoint is never held in memory.

    Reads happen on the event loop: from the page cache a 1 MiB ``pread`` costs far less than a
    thread hop, and the fake hub has no other work to keep responsive.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._size = path.stat().st_size
        self._fd: int | None = None
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDONLY)
            fd = self._fd
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"{self._path} changed while being served")
        return data

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


@dataclass(frozen=True, slots=True)
class RepoFile:
    path: str
    size: int
    sha256: str
    blob_id: str
    """git blob sha1 of the content, or of the LFS pointer for LFS files."""
    pointer_size: int | None
    """Size of the LFS pointer file; None for files stored in git."""
    blob: Blob = field(compare=False)

    @property
    def lfs(self) -> bool:
        return self.pointer_size is not None

    @property
    def etag(self) -> str:
        return f'"{self.sha256 if self.lfs else self.blob_id}"'


@dataclass(frozen=True, slots=True)
class Commit:
    sha: str
    files: Mapping[str, RepoFile]
    """By path, sorted."""

    def tree(self, prefix: str, *, recursive: bool) -> list[dict[str, Any]]:
        """Tree-listing entries under `prefix` ("" for the root), directories included."""
        base = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, file in self.files.items():
            if not path.startswith(base):
                continue
            parts = path[len(base) :].split("/")
            for depth in range(1, len(parts)):
                directory = base + "/".join(parts[:depth])
                entries.setdefault(directory, directory_entry(directory))
                if not recursive:
                    break
            else:
                entries[path] = file_entry(file)
        return [entries[path] for path in sorted(entries)]


@dataclass(slots=True)
class Repo:
    repo_id: str
    gated: bool
    token: str | None
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)

    def commit(self, revision: str) -> Commit | None:
        sha = self.refs.get(revision, revision)
        return self.commits.get(sha)

    def split_revision(self, rest: str, *, need_path: bool) -> tuple[str, str]:
        """Split ``{revision}/{path}`` where the revision may contain slashes (``refs/pr/1``).

        The longest known revision wins; if none is known the first segment is taken as the
        (missing) revision so the caller can report it.
        """
        parts = rest.split("/")
        longest = len(parts) - 1 if need_path else len(parts)
        for n in range(longest, 0, -1):
            revision = "/".join(parts[:n])
            if self.commit(revision) is not None:
                return revision, "/".join(parts[n:])
        return parts[0], "/".join(parts[1:])


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    lines = ("version https://git-lfs.github.com/spec/v1", f"oid sha256:{sha256}", f"size {size}")
    return ("\n".join(lines) + "\n").encode()


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size > LFS_THRESHOLD


def make_file(path: str, source: bytes | Path) -> RepoFile:
    blob: Blob
    if isinstance(source, Path):
        blob = FileBlob(source)
        with source.open("rb") as f:
            sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    else:
        blob = MemoryBlob(source)
        sha256 = hashlib.sha256(source).hexdigest()
    if is_lfs(path, blob.size):
        pointer = lfs_pointer(sha256, blob.size)
        return RepoFile(path, blob.size, sha256, git_blob_id(pointer), len(pointer), blob)
    content = source.read_bytes() if isinstance(source, Path) else source
    return RepoFile(path, blob.size, sha256, git_blob_id(content), None, blob)


def file_entry(file: RepoFile) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "file", "path": file.path}
    entry |= {"oid": file.blob_id, "size": file.size}
    if file.pointer_size is not None:
        entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": file.pointer_size}
    return entry


def directory_entry(path: str) -> dict[str, Any]:
    oid = hashlib.sha1(b"tree " + path.encode(), usedforsecurity=False).hexdigest()
    return {"type": "directory", "oid": oid, "size": 0, "path": path}


def sibling(file: RepoFile, *, blobs: bool) -> dict[str, Any]:
    sibling: dict[str, Any] = {"rfilename": file.path}
    if blobs:
        sibling["size"] = file.size
        sibling["blobId"] = file.blob_id
        if file.pointer_size is not None:
            sibling["lfs"] = {
                "sha256": file.sha256,
                "size": file.size,
                "pointerSize": file.pointer_size,
            }
    return sibling


def content_commit(repo_id: str, files: Mapping[str, RepoFile]) -> str:
    digest = hashlib.sha1(f"commit {repo_id}\n".encode(), usedforsecurity=False)
    for path, file in files.items():
        digest.update(f"{file.blob_id} {path}\n".encode())
    return digest.hexdigest()
