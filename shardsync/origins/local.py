"""A local directory as an origin: copy into the cache, hashing on the way."""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardsync.errors import ConfigError, EntryNotFoundError, OriginError
from shardsync.manifest import (
    UNSAFE_NAMES,
    Listing,
    ManifestEntry,
    RemoteFile,
    is_safe_name,
    leave_out,
    validate_name,
)
from shardsync.origins.base import Entry, Forget, Http, Into, Progress
from shardsync.records import RepoRef, VerifiedFile

__all__ = ["LocalOrigin"]

_STEP = 8 << 20


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

    @property
    def caller_only(self) -> bool:
        return True

    async def list_files(self, fetcher: Http, revision: str, *, hidden: bool = False) -> Listing:
        if revision != self.default_revision:
            raise ConfigError("a local directory has no revisions")
        return await asyncio.to_thread(self._walk, hidden)

    def _walk(self, hidden: bool) -> Listing:
        files: list[RemoteFile] = []
        unsafe: list[str] = []
        outside: list[str] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if hidden or not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith(".") and not hidden:
                    continue
                full = Path(dirpath, name)
                rel = full.relative_to(self.root).as_posix()
                if not is_safe_name(rel):
                    unsafe.append(rel)
                    continue
                size = self._size(full)
                if size == "outside":
                    outside.append(rel)
                elif size is not None:
                    files.append(RemoteFile(path=rel, size=size, sha256=None))
        leave_out(unsafe, str(self.root), UNSAFE_NAMES)
        leave_out(outside, str(self.root), f"that are symlinks out of {self.root}")
        return Listing(commit=None, files=tuple(files), exhaustive=True)

    def _size(self, full: Path) -> int | Literal["outside"] | None:
        """A regular file's size; None for what is not one, or is gone since the directory
        was read (a checkpoint being written); "outside" for a symlink out of the root,
        which is not followed even to stat it. One stat, so a file cannot vanish between
        the look at its kind and the one at its size."""
        try:
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                if not full.resolve().is_relative_to(self.root):
                    return "outside"
                st = full.stat()
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None  # gone meanwhile, a dangling link, a link loop: not a file
            raise OriginError(f"cannot look at {full}: {exc.strerror}") from exc
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def source(self, path: str) -> Path:
        """The file behind a repo path, refusing names and symlinks that leave the root."""
        full = (self.root / validate_name(path)).resolve()
        if not full.is_relative_to(self.root):
            raise ConfigError(f"{path!r} points outside {self.root}")
        if not full.is_file():
            raise EntryNotFoundError(f"{path}: not found under {self.root}")
        return full

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        # ctime too: a rewrite in place that restores the mtime (``cp -p``, ``rsync
        # --inplace -t``) keeps inode, size and mtime, but every write or utime moves ctime
        st = await asyncio.to_thread(self.source(entry.path).stat)
        return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"

    def locate_ahead(self, fetcher: Http, commit: str | None, entry: Entry) -> Forget:
        return _nothing  # a path is where it is

    async def read_range(
        self, fetcher: Http, commit: str | None, entry: Entry, start: int, end: int
    ) -> bytes:
        return await asyncio.to_thread(self._read, entry.path, start, end)

    def _read(self, path: str, start: int, end: int) -> bytes:
        with self.source(path).open("rb") as f:
            f.seek(start)
            return f.read(max(end - start, 0))

    async def download(
        self,
        fetcher: Http,
        commit: str | None,
        entry: ManifestEntry,
        into: Into,
        progress: Progress,
    ) -> VerifiedFile:
        """A copy with sha256 and xxh3 in the same pass, between two looks at the file's
        version: a file changed while it was copied (a checkpoint still being written in
        place) may have given bytes of both versions, so that copy is refused (its slot
        drops it, unpublished) and the error says to run again."""
        version = await self.version(fetcher, entry)
        fetched = await into.copy(self.source(entry.path), version, entry.path)
        now = await self.version(fetcher, entry)
        if now != version:
            raise OriginError(
                f"{entry.path} changed under {self.root} while it was copied "
                f"({version} -> {now}); nothing of it was kept: run again once it is written"
            )
        if entry.sha256 is not None and fetched.sha256 != entry.sha256:
            # known before the copy: the bytes a training checkpoint was chosen by
            raise OriginError(
                f"{entry.path} changed under {self.root} since it was read (sha256 "
                f"{entry.sha256[:12]}..., now {fetched.sha256[:12]}...); nothing of it was "
                "kept: run again"
            )
        progress(fetched.size)
        return fetched

    async def aclose(self) -> None:
        return None


def _nothing() -> None:
    return None
