"""Byte ranges of a training run's files, kept in the cache so a repeat read is local.

``DCPReader`` reads only the byte ranges its load plan names. This module is where those
ranges live between loads, and where a reader looks first:

1. **A whole, verified copy.** When the file is complete in the cache (``shardsync prefetch
   --checkpoint``), its store blob: the one named by the listing's sha256 (S3 stores that
   keep checksums), else the blob a snapshot record of this origin holds for the same path,
   size and origin version (a local directory's inode, size and mtime). Blobs are verified
   before they are published (promise 1), so they are read as they are.
2. **Kept pieces.** Ranges read from the origin earlier, written at their offsets into a
   sparse ``R/partial/r-<40 hex>.part`` with a sidecar ``.json`` naming the file's size,
   the version the origin gave it (ETag, or a local stat), and each piece's offset, length
   and xxh3-128. A piece is used only while the origin still names the same size and
   version, and only if its bytes still hash to what was recorded (a mismatch is a miss:
   the range is read again). Pieces are never published as blobs: a range cannot be
   checked against a whole-file sha256, so they are trusted on first use, tied to the
   version the origin named before and after they were read (the reader refuses a file
   whose version changed while it read it).

This module owns the ``r-`` keys under ``R/partial`` (paths from the cache layout): nothing
else reads or writes them. ``prune`` counts them as partial downloads and removes them once
unused for ``stale_partial_age``; readers never depend on them being there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from shardsync import layout
from shardsync.cache import CacheStore, temp_name
from shardsync.errors import disk_error
from shardsync.locks import BlobLock

if TYPE_CHECKING:
    from shardsync.records import FileRecord, RepoRef

__all__ = ["KeptFile", "Piece", "RangeCache", "pread_exact"]

_FORMAT = 1
_MAX_SIDECAR = 64 << 20
_XXH_RE = re.compile(r"[0-9a-f]{32}")
_LOCK_WAIT = 10.0  # seconds; past it the new pieces are dropped (lost work, never wrong bytes)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``[start, end)`` of an origin file, and their xxh3-128."""

    start: int
    end: int
    xxh3_128: str


def pread_exact(fd: int, start: int, end: int) -> bytes | None:
    """Bytes ``[start, end)`` of ``fd``; None when the file is shorter."""
    parts: list[bytes] = []
    offset = start
    while offset < end:
        chunk = os.pread(fd, min(end - offset, 1 << 30), offset)
        if not chunk:
            return None
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view[: 1 << 30], offset)
        view, offset = view[written:], offset + written


class RangeCache:
    """The kept ranges and whole copies of one origin's files in one cache."""

    def __init__(self, cache: CacheStore, repo: RepoRef) -> None:
        self.cache = cache
        self.repo = repo
        self._records: dict[str, list[FileRecord]] | None = None

    def key(self, path: str) -> str:
        ident = f"ranges\0{self.repo.kind}\0{self.repo.name}\0{path}"
        return "r-" + hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:40]

    def whole(self, path: str, size: int, sha256: str | None, version: str | None) -> Path | None:
        """The store blob of a complete copy of ``path`` as the origin has it now, if any:
        by the origin's sha256, else by a snapshot record with the same origin version."""
        if sha256 is not None and self.cache.has_blob(sha256, size):
            return self.cache.blob_path(sha256)
        for record in self._snapshot_files().get(path, ()):
            if record.size != size:
                continue
            same = (
                record.sha256 == sha256
                if sha256 is not None
                else version is not None and record.origin_etag == version
            )
            if same and self.cache.has_blob(record.sha256, size):
                return self.cache.blob_path(record.sha256)
        return None

    def _snapshot_files(self) -> dict[str, list[FileRecord]]:
        if self._records is None:
            found: dict[str, list[FileRecord]] = {}
            dirname = self.repo.dirname
            for name, _commit, record in self.cache.snapshot_records():
                if name != dirname or record is None or record.repo != self.repo:
                    continue
                for f in record.files:
                    found.setdefault(f.path, []).append(f)
            self._records = found
        return self._records

    def open(self, path: str, size: int, version: str) -> KeptFile:
        return KeptFile(self.cache, self.key(path), path, size, version)


class KeptFile:
    """The kept pieces of one origin file at one (size, version).

    ``read`` and ``add`` may be called from several threads at once (positional I/O on
    descriptors opened up front or under a lock); ``commit`` once at the end.
    """

    def __init__(self, cache: CacheStore, key: str, path: str, size: int, version: str) -> None:
        self.cache = cache
        self.key = key
        self.path = path
        self.size = size
        self.version = version
        self.data_path, self.sidecar_path = cache.layout.partial(key)
        self._lock = threading.Lock()
        self._pieces: dict[tuple[int, int], str] = {}
        self._new: list[Piece] = []
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._used = False
        pieces = self._load_sidecar() or []
        if pieces:
            try:
                self._read_fd = os.open(self.data_path, _READ_FLAGS)
            except OSError:
                pieces = []
        self._pieces = {(p.start, p.end): p.xxh3_128 for p in pieces}

    # -- reading

    def has(self, start: int, end: int) -> bool:
        return (start, end) in self._pieces

    def read(self, start: int, end: int) -> bytes | None:
        """The kept bytes ``[start, end)`` if they are there and still hash to what was
        recorded; None otherwise (the caller reads them from the origin)."""
        digest = self._pieces.get((start, end))
        if digest is None or self._read_fd is None:
            return None
        data = pread_exact(self._read_fd, start, end)
        if data is None or xxhash.xxh3_128_hexdigest(data) != digest:
            with self._lock:
                self._pieces.pop((start, end), None)
            return None
        self._used = True
        return data

    # -- writing

    def add(self, start: int, data: bytes | memoryview) -> None:
        """Keep ``data`` read from the origin at ``start`` (listed by ``commit``)."""
        end = start + len(data)
        if not 0 <= start < end <= self.size:
            return
        fd = self._writer()
        if fd is None:
            return  # the key's lock was not had in time: not kept (read again next time)
        piece = Piece(start, end, xxhash.xxh3_128_hexdigest(data))
        _pwrite_all(fd, data, start)
        with self._lock:
            self._new.append(piece)

    def _writer(self) -> int | None:
        """The ``.part`` that holds this version, opened for writing. Under the key's lock:
        join the one there if its sidecar names this version, else put a new empty one in
        its place (and a sidecar naming this version with no pieces), so every writer of a
        version adds to the same file whatever the order they came in."""
        with self._lock:
            if self._write_fd is not None:
                return self._write_fd
            lock = self._acquire()
            if lock is None:
                return None
            try:
                if self._load_sidecar() is not None:
                    with contextlib.suppress(FileNotFoundError):
                        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
                        self._write_fd = os.open(self.data_path, flags)
                        return self._write_fd
                fresh = self.cache.layout.path(*layout.TMP, temp_name("ranges"))
                flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(fresh, flags, 0o644)
                try:
                    os.replace(fresh, self.data_path)
                    self._write_sidecar([])
                except BaseException:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        fresh.unlink()
                    raise
                self._write_fd = fd
                return fd
            finally:
                lock.release()

    def _acquire(self) -> BlobLock | None:
        lock = self.cache.lock(self.key)
        deadline = time.monotonic() + _LOCK_WAIT
        while not lock.try_acquire():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)
        return lock

    def commit(self) -> int:
        """Make the pieces added so far durable and listed; returns their bytes. Data
        fsynced first, then, under the key's lock, the sidecar replaced (the commit point).
        Pieces written to a file that is no longer the key's ``.part`` of this version
        (replaced by a newer version, pruned) are dropped: lost work, never wrong bytes."""
        with self._lock:
            new, self._new = self._new, []
        if not new:
            if self._used:
                with contextlib.suppress(OSError):
                    os.utime(self.sidecar_path)  # in use: not a stale leftover for prune
            return 0
        assert self._write_fd is not None
        os.fsync(self._write_fd)
        lock = self._acquire()
        if lock is None:
            return 0
        try:
            current = self._load_sidecar()
            try:
                same_file = os.stat(self.data_path)[1:3] == os.fstat(self._write_fd)[1:3]
            except FileNotFoundError:
                same_file = False
            if current is None or not same_file:
                return 0
            self._write_sidecar([*current, *new])
        finally:
            lock.release()
        return sum(p.end - p.start for p in new)

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = None

    # -- the sidecar

    def _load_sidecar(self) -> list[Piece] | None:
        """The pieces the sidecar lists for this path, size and version; None when it is
        absent, malformed or about another version (stale pieces are never used)."""
        try:
            fd = os.open(self.sidecar_path, _READ_FLAGS)
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                raw = f.read(_MAX_SIDECAR + 1)
            obj = json.loads(raw)
        except (OSError, ValueError):
            return None
        if (
            not isinstance(obj, dict)
            or obj.get("format") != _FORMAT
            or obj.get("path") != self.path
            or obj.get("size") != self.size
            or obj.get("version") != self.version
            or not isinstance(obj.get("pieces"), list)
        ):
            return None
        pieces: dict[tuple[int, int], Piece] = {}
        for item in obj["pieces"]:
            if not (isinstance(item, list) and len(item) == 3):
                return None
            start, end, digest = item
            if (
                not all(type(v) is int for v in (start, end))
                or not 0 <= start < end <= self.size
                or not isinstance(digest, str)
                or not _XXH_RE.fullmatch(digest)
            ):
                return None
            pieces[(start, end)] = Piece(start, end, digest)
        return list(pieces.values())

    def _write_sidecar(self, pieces: Iterable[Piece]) -> None:
        unique = {(p.start, p.end): p for p in pieces}
        obj = {
            "format": _FORMAT,
            "path": self.path,
            "size": self.size,
            "version": self.version,
            "pieces": [[p.start, p.end, p.xxh3_128] for _, p in sorted(unique.items())],
        }
        data = json.dumps(obj, separators=(",", ":")).encode()
        try:
            self.cache.fs.atomic_write(
                layout.PARTIAL, self.sidecar_path.name, data, purpose="ranges"
            )
        except OSError as exc:
            raise disk_error(
                exc, f"keep read ranges of {self.path}", then="they are read again next time"
            ) from exc
