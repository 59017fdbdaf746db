"""Locks between processes that a crash cannot leave behind: ``flock`` on a file of its own.

Correctness never depends on them (every cache entry appears by an atomic rename or link);
they keep two processes from doing the same download, or a prune from racing a lease.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path
from typing import Self

from shardsync.errors import CacheError, disk_error

__all__ = ["BlobLock"]

_FILE_MODE = 0o644


class BlobLock:
    """A cross-process lock on one key: ``flock`` on its own open file description.

    Two ``BlobLock`` objects exclude each other even inside one process. The kernel releases
    the lock when its holder dies, so a crashed holder is taken over at once. Not reentrant:
    acquiring a lock this object already holds returns at once, and one ``release`` frees it.
    Only a holder unlinks a lock file (``remove_idle_locks``), and an acquirer checks after
    locking that the path still names the file it locked, else tries again: two holders never
    lock different inodes.
    ``shared=True`` takes a shared lock instead: shared holders coexist and an exclusive holder
    excludes them all (the prune gate: lease takers share it, a prune holds it alone).
    """

    __slots__ = ("_fd", "_path", "_shared")

    def __init__(self, path: Path, *, shared: bool = False) -> None:
        self._path = path
        self._shared = shared
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self._path

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free; never blocks."""
        if self._fd is not None:
            return True
        while True:
            try:
                fd = os.open(
                    self._path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, _FILE_MODE
                )
            except OSError as exc:
                raise disk_error(exc, f"open lock file {self._path}") from exc
            try:
                mode = fcntl.LOCK_SH if self._shared else fcntl.LOCK_EX
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                here = os.fstat(fd)
                there = os.stat(self._path, follow_symlinks=False)
            except BlockingIOError:
                os.close(fd)
                return False
            except FileNotFoundError:
                os.close(fd)
                continue  # removed by its last holder meanwhile: lock the new one
            except OSError as exc:
                os.close(fd)
                raise disk_error(exc, f"lock {self._path}") from exc
            if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
                os.close(fd)
                continue
            self._fd = fd
            return True

    async def acquire(
        self,
        *,
        poll: float = 0.05,
        timeout: float | None = None,  # noqa: ASYNC109 - the wait ends in CacheError
    ) -> None:
        """Poll ``try_acquire`` without blocking the event loop; ``CacheError`` on timeout.

        Polling is the design: another process's ``flock`` release has no event to await.
        """
        try:
            async with asyncio.timeout(timeout):
                while not self.try_acquire():  # noqa: ASYNC110 - see the docstring
                    await asyncio.sleep(poll)
        except TimeoutError as exc:
            raise CacheError(f"timed out after {timeout} s waiting for lock {self._path}") from exc

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); a no-op when not held."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    async def __aenter__(self) -> Self:
        await self.acquire()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()
