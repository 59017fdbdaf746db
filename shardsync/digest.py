"""One pass over a file's bytes computing the hashes a cache checks it by (sha256, xxh3-128,
git's blob id), optionally copying it on the way: the one hashing loop of whole files."""

from __future__ import annotations

import hashlib
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

    def read(self, src: IO[bytes], *, copy_to: IO[bytes] | None = None) -> Digest:
        """Hash ``src`` to its end (writing each chunk to ``copy_to`` too); returns self."""
        while chunk := src.read(CHUNK):
            if copy_to is not None:
                copy_to.write(chunk)
            self._xxh3.update(chunk)
            for h in (self._sha256, self._git):
                if h is not None:
                    h.update(chunk)
            self.nbytes += len(chunk)
        return self

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
