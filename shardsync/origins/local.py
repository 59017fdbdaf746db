"""A local directory as an origin: copy into the cache, hashing on the way."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import xxhash

from shardsync.cache import RepoRef
from shardsync.errors import ConfigError, EntryNotFoundError
from shardsync.manifest import Listing, RemoteFile, validate_name

__all__ = ["Copied", "LocalOrigin"]

_STEP = 8 << 20


@dataclass(frozen=True, slots=True)
class Copied:
    size: int
    sha256: str
    xxh3_128: str
    identity: tuple[int, int]  # (st_dev, st_ino) of the copy that was hashed


@dataclass(frozen=True, slots=True)
class LocalOrigin:
    """A checkpoint directory (an NFS mount, a scratch disk); symlinks out of it are refused."""

    root: Path
    default_revision: str = "main"

    @classmethod
    def from_path(cls, path: str) -> LocalOrigin:
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            raise ConfigError(f"not a directory: {path!r}")
        return cls(root=root)

    @property
    def repo(self) -> RepoRef:
        return RepoRef(kind="local", name=str(self.root))

    def list_files(self, revision: str) -> Listing:
        if revision != self.default_revision:
            raise ConfigError("a local directory has no revisions")
        files: list[RemoteFile] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if name.startswith(".") or not full.is_file():
                    continue
                rel = full.relative_to(self.root).as_posix()
                files.append(
                    RemoteFile(path=validate_name(rel), size=full.stat().st_size, sha256=None)
                )
        return Listing(commit=None, files=tuple(files), exhaustive=True)

    def source(self, path: str) -> Path:
        full = (self.root / validate_name(path)).resolve()
        if not full.is_relative_to(self.root):
            raise ConfigError(f"{path!r} points outside {self.root}")
        if not full.is_file():
            raise EntryNotFoundError(f"{path}: not found under {self.root}")
        return full

    def copy(self, path: str, dest: Path) -> Copied:
        """Blocking copy with sha256 and xxh3 computed in the same pass (run in a thread)."""
        sha, xxh, size = hashlib.sha256(), xxhash.xxh3_128(), 0
        with self.source(path).open("rb") as src, dest.open("xb") as out:
            while chunk := src.read(_STEP):
                sha.update(chunk)
                xxh.update(chunk)
                out.write(chunk)
                size += len(chunk)
            st = os.fstat(out.fileno())
        return Copied(
            size=size,
            sha256=sha.hexdigest(),
            xxh3_128=xxh.hexdigest(),
            identity=(st.st_dev, st.st_ino),
        )
