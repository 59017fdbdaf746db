"""A local directory as an origin: copy into the cache, hashing on the way."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

from shardsync.errors import ConfigError, EntryNotFoundError, OriginError
from shardsync.manifest import Listing, ManifestEntry, RemoteFile, validate_name
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
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if hidden or not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath, name)
                if (name.startswith(".") and not hidden) or not full.is_file():
                    continue
                rel = full.relative_to(self.root).as_posix()
                files.append(
                    RemoteFile(path=validate_name(rel), size=full.stat().st_size, sha256=None)
                )
        return Listing(commit=None, files=tuple(files), exhaustive=True)

    def source(self, path: str) -> Path:
        """The file behind a repo path, refusing names and symlinks that leave the root."""
        full = (self.root / validate_name(path)).resolve()
        if not full.is_relative_to(self.root):
            raise ConfigError(f"{path!r} points outside {self.root}")
        if not full.is_file():
            raise EntryNotFoundError(f"{path}: not found under {self.root}")
        return full

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        st = await asyncio.to_thread(self.source(entry.path).stat)
        return f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}"

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
        fetched = await into.copy(self.source(entry.path), version)
        now = await self.version(fetcher, entry)
        if now != version:
            raise OriginError(
                f"{entry.path} changed under {self.root} while it was copied "
                f"({version} -> {now}); nothing of it was kept: run again once it is written"
            )
        progress(fetched.size)
        return fetched

    async def aclose(self) -> None:
        return None


def _nothing() -> None:
    return None
