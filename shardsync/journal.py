"""The daemon's job journal: unfinished jobs on disk, so a restart resumes them.

One small JSON file (``<cache>/state/daemon/jobs.json``), replaced on every change by the
cache's one atomic write (``CacheStore.write_state_file``: temp file, fsync, rename, fsync of
the directory), so a ``kill -9`` at any moment leaves the previous list or the new one. It
names jobs only; the bytes already downloaded are in the fetcher's partial files, which the
resumed jobs pick up. The write runs through ``AsyncStore`` and reads through aiofiles, so
the daemon's event loop never waits on the disk.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Protocol

import aiofiles
import aiofiles.os

from shardsync import layout
from shardsync.errors import CacheError
from shardsync.layout import CacheLayout

__all__ = ["Journal", "StateFiles"]

log = logging.getLogger("shardsync.journal")

_FORMAT = 1
_MAX_SIZE = 16 << 20


class StateFiles(Protocol):
    """What the journal needs of the cache (``store.AsyncStore`` has it): where its file
    lives and the atomic write. Named here so the journal sits beside the cache's facade,
    not above it."""

    @property
    def layout(self) -> CacheLayout:
        """The cache's paths (``CacheLayout.journal``)."""

    async def write_state_file(self, *parts: str, data: bytes) -> None:
        """Replace one state file atomically and durably."""


class Journal:
    """Reads and atomically rewrites the list of unfinished jobs (opaque JSON records)."""

    def __init__(self, store: StateFiles) -> None:
        self._store = store
        self.path = store.layout.journal()

    async def load(self) -> list[dict[str, Any]]:
        """The records of the last save; a missing journal is empty, a corrupt one is set
        aside (renamed ``*.corrupt-<time>``) so a bad file never keeps the daemon down."""
        try:
            async with aiofiles.open(self.path, "rb") as f:
                data = await f.read(_MAX_SIZE + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CacheError(f"cannot read the job journal {self.path}: {exc.strerror}") from exc
        try:
            obj = json.loads(data)
            if len(data) > _MAX_SIZE or not isinstance(obj, dict) or obj.get("format") != _FORMAT:
                raise ValueError("not a version 1 journal")
            jobs = obj["jobs"]
            if not isinstance(jobs, list) or not all(isinstance(j, dict) for j in jobs):
                raise ValueError("'jobs' is not a list of objects")
        except (ValueError, KeyError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.warning("job journal %s is unreadable (%s); moved to %s", self.path, exc, aside)
            with contextlib.suppress(OSError):
                await aiofiles.os.replace(self.path, aside)
            return []
        return jobs

    async def save(self, records: list[dict[str, Any]]) -> None:
        """Replace the journal with ``records``; durable when this returns. Past what
        ``load`` reads (``_MAX_SIZE``) the last records are left out, with a warning: a
        journal too large to load would be set aside whole, and resume none."""
        kept = records
        while True:
            document = {"format": _FORMAT, "jobs": kept}
            data = json.dumps(document, ensure_ascii=False, indent=1).encode() + b"\n"
            if len(data) <= _MAX_SIZE or not kept:
                break
            kept = kept[: len(kept) * _MAX_SIZE // len(data)]  # fewer each time
        if len(kept) < len(records):
            log.warning(
                "the job journal holds %d of %d unfinished jobs (%d bytes at most): the rest "
                "are not resumed after a restart",
                len(kept),
                len(records),
                _MAX_SIZE,
            )
        await self._store.write_state_file(*layout.JOURNAL, data=data)
