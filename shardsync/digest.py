"""The hashes a cache checks a file by (sha256, xxh3-128, git's blob id, an object store's
checksum), fed in order from a file object, a file's pages in place (``MappedFile``) or a file
descriptor's range: the one hashing loop. A download feeds its contiguous prefix as it grows;
``verify`` and local copies read a whole file."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from typing import IO

import xxhash

from shardsync.checksums import DIGEST_SIZE, StoreChecksum

__all__ = ["Digest", "MappedFile", "StoreHasher"]

CHUNK = 256 << 10
"""Bytes fed to the hashes at a time: small enough to stay in a core's L2 cache, so the first
hash pulls them in from memory and the others read them there. Over a 1 GB file in the page
cache, sha256 + xxh3 + crc32 took 0.73-0.76 CPU-s/GB in 256 KiB or 512 KiB pieces and
0.97-1.02 in 8 MiB ones (bench/README.md, s3.py, "Hashing in cache-sized pieces")."""


class Digest:
    """Hashes of the bytes read so far; ``nbytes`` stays right when a read fails midway."""

    __slots__ = ("_git", "_sha256", "_xxh3", "nbytes", "store")

    def __init__(
        self,
        *,
        sha256: bool = True,
        git_size: int | None = None,
        store: StoreChecksum | None = None,
    ) -> None:
        self._xxh3 = xxhash.xxh3_128()
        self._sha256 = hashlib.sha256() if sha256 else None
        self._git = None
        if git_size is not None:  # git hashes a header naming the size first
            self._git = hashlib.sha1(b"blob %d\0" % git_size, usedforsecurity=False)
        self.store = StoreHasher(store) if store is not None else None
        self.nbytes = 0

    def update(self, data: bytes | memoryview) -> None:
        """The next bytes of the file, in order."""
        self._xxh3.update(data)
        for h in (self._sha256, self._git, self.store):
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


class StoreHasher:
    """Checks bytes, fed in order, against an object store's checksum: of the whole object,
    or part by part for a composite one (each part's digest, then the digest of those)."""

    __slots__ = ("_checksum", "_digests", "_left", "_over", "_sizes", "_state")

    def __init__(self, checksum: StoreChecksum) -> None:
        if not checksum.checkable:
            raise ValueError("a composite checksum is checked with its parts' sizes")
        self._checksum = checksum
        self._sizes = iter(checksum.part_sizes)
        self._left = next(self._sizes, 0)  # bytes left in the part being hashed
        self._over = False  # more bytes than the parts hold
        self._digests: list[bytes] = []
        self._state = _Running(checksum)

    def update(self, data: bytes | memoryview) -> None:
        if not self._checksum.composite:
            self._state.update(data)
            return
        view = memoryview(data)
        while len(view):
            if self._left == 0:
                self._over = True
                return
            take = min(self._left, len(view))
            self._state.update(view[:take])
            view, self._left = view[take:], self._left - take
            if self._left == 0:
                self._digests.append(self._state.digest())
                self._state = _Running(self._checksum)
                self._left = next(self._sizes, 0)

    def matches(self) -> bool:
        """Whether the bytes fed so far are the whole object the checksum names."""
        checksum = self._checksum
        if not checksum.composite:
            return self._state.digest() == checksum.digest
        if self._over or len(self._digests) != checksum.parts:
            return False
        whole = _Running(checksum)
        whole.update(b"".join(self._digests))
        return whole.digest() == checksum.digest


class _Running:
    """One running digest of ``checksum``'s algorithm: hashlib's; ISA-L's CRC32 (3.3x
    zlib's speed here: 0.09 against 0.29 CPU-s/GB, and awscrt's took 0.44); awscrt's CRC32C
    and CRC64NVME (botocore's own choice, 0.10). The CRC libraries are imported only when an
    object needs them."""

    __slots__ = ("_crc", "_hash", "_size", "_value")

    def __init__(self, checksum: StoreChecksum) -> None:
        algorithm = checksum.algorithm
        self._size = DIGEST_SIZE[algorithm]
        self._hash = None
        self._crc: Callable[[bytes | memoryview, int], int] | None = None
        self._value = 0
        if algorithm in ("sha256", "sha1"):
            self._hash = hashlib.new(algorithm, usedforsecurity=False)
        elif algorithm == "crc32":
            from isal import isal_zlib

            self._crc = isal_zlib.crc32
        else:
            from awscrt import checksums

            self._crc = checksums.crc32c if algorithm == "crc32c" else checksums.crc64nvme

    def update(self, data: bytes | memoryview) -> None:
        if self._hash is not None:
            self._hash.update(data)
        elif self._crc is not None:
            self._value = self._crc(data, self._value)

    def digest(self) -> bytes:
        if self._hash is not None:
            return self._hash.digest()
        return self._value.to_bytes(self._size, "big")


class MappedFile:
    """A file's bytes hashed in order where they lie in the page cache: read-only mappings of
    one ``window`` at a time, so nothing is copied out and a page fault maps 16 pages.

    Each window is unmapped as soon as the hash passes its end, so a download's RSS holds one
    window per file, not the file. Unmapping lets other threads run, where ``madvise`` (the
    page release this replaced) held the GIL: py-spy counted 0.17 s of it in a 1 GB daemon
    download, with the pump threads waiting. Where the file cannot be mapped the rest is read
    with ``pread``.
    """

    def __init__(self, fd: int, size: int, *, window: int = 16 << 20) -> None:
        if window <= 0 or window % mmap.ALLOCATIONGRANULARITY:
            raise ValueError("a window is a whole number of allocation units")
        self._fd = fd
        self._size = size
        self._window_size = window
        self._window: mmap.mmap | None = None
        self._base = 0
        self._mappable = True

    def hash_into(self, digest: Digest, start: int, end: int) -> int:
        """Feed bytes ``[start, end)`` to ``digest``; returns where it got (short only if the
        file shrank, read with ``pread``)."""
        pos = start
        while pos < end:
            window = self._window_at(pos)
            if window is None:
                return digest.update_from_fd(self._fd, pos, end)
            stop = min(end, self._base + len(window))
            with memoryview(window) as view:
                for at in range(pos - self._base, stop - self._base, CHUNK):
                    with view[at : min(stop - self._base, at + CHUNK)] as piece:
                        digest.update(piece)
            pos = stop
            if stop == self._base + len(window):
                self.close()
        return end

    def _window_at(self, pos: int) -> mmap.mmap | None:
        base = pos - pos % self._window_size
        if self._window is not None and self._base == base:
            return self._window
        self.close()
        if not self._mappable:
            return None
        try:
            self._window = mmap.mmap(
                self._fd,
                min(self._window_size, self._size - base),
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ,
                offset=base,
            )
        except (OSError, ValueError):  # not mappable here (or shrunk): ``pread`` says why
            self._mappable = False
            return None
        self._base = base
        return self._window

    def close(self) -> None:
        """Unmap the window in use (the bytes stay in the page cache)."""
        window, self._window = self._window, None
        if window is not None:
            window.close()
