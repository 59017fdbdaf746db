"""The cache for code on an event loop: the one rule for blocking work.

``CacheStore`` and ``Slot`` are synchronous and fsync (a blob, its folder, every folder of a
snapshot before its record). On the daemon's loop one job's fsync would stall every other
job's transfers, so coroutines never call them directly: they await ``AsyncStore``, which
runs each call in a worker thread. Paths (pure) are answered on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from shardsync.cache import CacheStore
from shardsync.digest import Digest
from shardsync.layout import CacheLayout
from shardsync.manifest import ManifestEntry
from shardsync.records import FileRecord, RepoRef, SnapshotRecord, VerifiedFile
from shardsync.removal import sweep_orphans
from shardsync.slot import Slot, remembered
from shardsync.tasks import to_the_end

__all__ = ["AsyncStore"]


class AsyncStore:
    """``CacheStore`` (``sync``) with every blocking call run off the event loop."""

    __slots__ = ("sync",)

    def __init__(self, sync: CacheStore) -> None:
        self.sync = sync

    @property
    def layout(self) -> CacheLayout:
        return self.sync.layout

    # -- blobs --------------------------------------------------------------------------

    async def has_blob(self, sha256: str, size: int | None = None) -> bool:
        return await asyncio.to_thread(self.sync.has_blob, sha256, size)

    async def missing_bytes(self, entries: Iterable[ManifestEntry]) -> int:
        """Bytes of the entries whose blob the store does not hold (all of an entry without
        a sha256): what downloading them may add to the disk."""
        entries = tuple(entries)

        def missing() -> int:
            return sum(
                e.size or 0
                for e in entries
                if not (e.sha256 is not None and self.sync.has_blob(e.sha256, e.size))
            )

        return await asyncio.to_thread(missing)

    async def read_blob(self, sha256: str, cap: int) -> bytes:
        """A small blob's first ``cap`` bytes (an index: its parser refuses one too long)."""

        def read() -> bytes:
            with self.sync.blob_path(sha256).open("rb") as f:
                return f.read(cap)

        return await asyncio.to_thread(read)

    async def hash_blob(self, sha256: str) -> Digest:
        """The xxh3-128 and size of a store blob no record describes."""

        def digest() -> Digest:
            with self.sync.blob_path(sha256).open("rb") as f:
                return Digest(sha256=False).read(f)

        return await asyncio.to_thread(digest)

    async def remembered(self, key: str, path: str) -> FileRecord | None:
        """What ``key``'s last download became (``slot.remembered``)."""
        return await asyncio.to_thread(remembered, self.sync.layout, key, path)

    async def slot(self, key: str) -> Slot:
        """The download slot of ``key`` (making it may create ``locks/`` and fsync the root)."""
        return await asyncio.to_thread(Slot, self.sync, key)

    async def commit(self, slot: Slot, file: VerifiedFile) -> Path:
        """Publish a verified download (``Slot.commit``: fsync, link, fsync the folder), to
        its end even when the job is cancelled meanwhile: one cancelled before its thread
        started left the file's private name in ``tmp/`` for the life of the process (a
        whole local copy's only name), and one still running would publish after the slot's
        lock was let go."""
        return await to_the_end(asyncio.to_thread(slot.commit, file))

    async def drop_leftover(self, slot: Slot) -> None:
        await asyncio.to_thread(slot.drop_leftover)

    async def sweep_orphans(self) -> int:
        return await asyncio.to_thread(sweep_orphans, self.sync)

    # -- snapshots ----------------------------------------------------------------------

    async def link_file(
        self, repo: RepoRef, commit: str, relpath: str, *, sha256: str, etag: str
    ) -> Path:
        return await asyncio.to_thread(
            self.sync.link_file, repo, commit, relpath, sha256=sha256, etag=etag
        )

    async def write_snapshot_record(self, record: SnapshotRecord) -> None:
        await asyncio.to_thread(self.sync.write_snapshot_record, record)

    async def write_ref(
        self, repo: RepoRef, revision: str, commit: str, resolved_at: float | None = None
    ) -> None:
        await asyncio.to_thread(self.sync.write_ref, repo, revision, commit, resolved_at)

    async def read_ref(self, repo: RepoRef, revision: str) -> str | None:
        return await asyncio.to_thread(self.sync.read_ref, repo, revision)

    async def read_snapshot_record(self, repo: RepoRef, commit: str) -> SnapshotRecord | None:
        return await asyncio.to_thread(self.sync.read_snapshot_record, repo, commit)

    # -- state files --------------------------------------------------------------------

    async def write_state_file(self, *parts: str, data: bytes) -> None:
        await asyncio.to_thread(self.sync.write_state_file, *parts, data=data)
