"""The hashes a cache checks a file by (sha256, xxh3-128, git's blob id), fed in order from
a file object, a mapping or a file descriptor's range: the one hashing loop. A download feeds
its contiguous prefix as it grows; ``verify`` and local copies read a whole file."""

from __future__ import annotations

import hashlib
import os
from typing import IO

import xxhash

__all__ = ["Digest"]

CHUNK = 8 << 20


class Digest:
    """Hashes of the bytes read so far; ``nbytes`` stays right when a read fails midway."""

    __slots__ = ("_git", "_sha256", "_xxh3", "nbytes")

    def __init__(self, *, sha256: bool = True, git_size: int | None = None) -> None:
        self._xxh3 = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None
        self._git = None
        if git_size is not None:  # git hashes a header naming the size first
            self._git = hashlib.sha1(b"blob %d\0" % git_size, usedforsecurity=False)
        self.nbytes = 0

    def update(self, data: bytes | memoryview) -> None:
        """The next bytes of the file, in order."""
        self._xxh3.update(data)
        for h in (self._sha256, self._git):
            if h is not None:
                h.update(data)
        self.nbytes += len(data)

    def read(self, src: IO[bytes], *, copy_to: IO[bytes] | None = None) -> Digest:
        """Hash ``src`` to its end (writing each chunk to ``copy_to`` too); returns self."""
        while chunk := src.read(CHUNK):
            if copy_to is not None:
                copy_to.write(chunk)
            self.update(chunk)
        return self

    def update_from_view(self, view: memoryview, start: int, end: int) -> int:
        """Hash ``view[start:end]`` where it lies (a mapped file: no copy out of the page
        cache); returns ``end``."""
        for pos in range(start, end, CHUNK):
            with view[pos : min(end, pos + CHUNK)] as piece:
                self.update(piece)
        return end

    def update_from_fd(self, fd: int, start: int, end: int) -> int:
        """Hash bytes ``start..end`` of ``fd`` read with ``pread``; returns where it got
        (short only if the file shrank)."""
        pos = start
        while pos < end:
            data = os.pread(fd, min(CHUNK, end - pos), pos)
            if not data:
                break
            self.update(data)
            pos += len(data)
        return pos

    @property
    def xxh3_128(self) -> str:
        return self._xxh3.hexdigest()

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            raise RuntimeError("made with sha256=False")
        return self._sha256.hexdigest()

    @property
    def git_sha1(self) -> str | None:
        return None if self._git is None else self._git.hexdigest()
