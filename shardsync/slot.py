"""Download slots: the one owner of a blob download between its first byte and its publish.

A slot is one key's lock (``locks/<key>.lock``), partial file (``partial/<key>.part``), resume
record (``partial/<key>.json``) and the download's private temp name in ``tmp/``. Its life:

* ``async with slot`` holds the key's lock (correctness never depends on it: every step
  below checks the inode it works on); left by an exception, it suspends;
* ``open`` gives the file to write into and the ranges a resume may keep; the fetcher writes
  there and saves progress into the ``ResumeRecord`` it gets, and names no path itself;
* ``copy_from`` is ``open``'s counterpart for an origin that copies (a local directory): a
  new private file, hashed on the way, never resumed;
* ``commit(verified)`` publishes the verified file into the store and forgets the partial;
  ``suspend`` keeps the partial for a later resume; ``abandon`` discards it. A key that is
  no sha256 (the file's was unknown before it was read) keeps a note of the blob it became
  (``partial/<key>.done``, ``remembered``): a later run finds that file again by it.

Prune, ``ls`` and the daemon ask this module what is in progress (``in_progress``), and which
leftovers may go (``remove_abandoned``, ``sweep_orphans``, ``remove_idle_locks``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast, get_args

import xxhash

from shardsync import layout, strict_json
from shardsync.digest import Digest
from shardsync.errors import CacheError, disk_error
from shardsync.layout import CacheLayout, temp_name
from shardsync.locks import BlobLock
from shardsync.names import is_sha256, is_xxh3_128
from shardsync.ranges import RangeSet
from shardsync.records import FileRecord, Verification, VerifiedFile

__all__ = [
    "BlobHome",
    "OpenPartial",
    "RecordKeeper",
    "Resumable",
    "ResumeRecord",
    "Seeding",
    "Slot",
    "forget_gone_blobs",
    "in_progress",
    "remembered",
    "remove_abandoned",
]

_RECORD_VERSION = 3
_MAX_RECORD = 1 << 20
_SUFFIXES = (".part", ".json")
_FLAGS = os.O_RDWR | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Resumable:
    """What a resume record binds a partial to: this exact object, or (``url`` None: bytes
    seeded from another host's parts, see ``Slot.seed``) any object with this sha256, whose
    hash at the end decides whether the seeded bytes were right."""

    url: str | None
    etag: str | None  # strong ETag; without one a partial never resumes
    size: int
    sha256: str | None


class ResumeRecord:
    """A download's resume record, open for its whole life and rewritten in place: one
    ``pwrite`` per save, no temp file or rename, so it can follow the data closely without
    churning the filesystem. It stays one JSON document (padded with spaces to the longest
    version written, as JSON allows) carrying a checksum of its own fields, so a record torn
    by a power loss resumes nothing. The format is version 3 of every release before slots."""

    __slots__ = ("fd", "inode", "length")

    def __init__(self, fd: int, inode: tuple[int, int]) -> None:
        self.fd = fd
        self.inode = inode
        self.length = 0

    def encode(self, what: Resumable, done: RangeSet) -> bytes:
        """The record of ``done`` ranges of ``what`` in this slot's file (taken on the event
        loop, so it is consistent; written by ``write`` in a worker thread)."""
        fields: dict[str, object] = {
            "version": _RECORD_VERSION,
            "url": what.url,
            "etag": what.etag,
            "size": what.size,
            "sha256": what.sha256,
            "inode": list(self.inode),
            "done": done.to_list(),
        }
        fields["check"] = _record_check(fields)
        body = json.dumps(fields, separators=(",", ":")).encode()
        self.length = max(self.length, len(body))
        return body.ljust(self.length)

    def write(self, blob: bytes) -> None:
        with contextlib.suppress(OSError):  # best effort: a stale record costs a re-download
            os.pwrite(self.fd, blob, 0)

    def close(self) -> None:
        os.close(self.fd)


class RecordKeeper:
    """What a download has on disk and its resume record, for any thread that lands bytes.

    Bytes land on worker threads (a file's pump, or the thread that ran a ``pwritev``). The
    thread that landed them saves the record itself once ``every`` bytes are unclaimed.
    Handed to the event loop and then to a worker first, the record trailed the file by
    7-25 MB at a ``kill -9`` of four 256 MB downloads against nginx, and the kill lost that
    too. A lock orders the saves: a record on disk never claims less than the one before.
    """

    def __init__(
        self,
        record: ResumeRecord | None,
        done: RangeSet,
        every: int,
        what: Callable[[], Resumable | None],
    ) -> None:
        """``what``: the object the record binds the partial to, None while it cannot be
        bound (no strong ETag yet); asked at every save."""
        self._record = record
        self._done = done.copy()
        self._every = every
        self._what = what
        self._unsaved = 0
        self._lock = threading.Lock()

    def landed(self, first: int, stop: int) -> None:
        """Bytes ``[first, stop)`` are in the file (the page cache): claim them, saving the
        record now if ``every`` bytes wait."""
        with self._lock:
            self._done.add(first, stop)
            self._unsaved += stop - first
            if self._unsaved >= self._every:
                self._save()

    def save(self) -> None:
        """Save the record if it claims less than is on disk (blocking: a worker thread)."""
        with self._lock:
            if self._unsaved:
                self._save()

    def _save(self) -> None:
        what = self._what()
        if self._record is None or what is None:
            return  # without a strong validator a partial can never be resumed safely
        blob = self._record.encode(what, self._done)
        self._unsaved = 0
        self._record.write(blob)


class Seeding:
    """A seeded partial being filled: ``write`` bytes where they belong, ``close`` when done
    (the record then claims what was written, and a download resumes from it)."""

    __slots__ = ("_done", "_fd", "_lock", "_record", "_what")

    def __init__(self, fd: int, record: ResumeRecord, what: Resumable) -> None:
        self._fd, self._record, self._what = fd, record, what
        self._done = RangeSet()
        self._lock = threading.Lock()  # pieces land from several threads at once

    def write(self, offset: int, data: bytes) -> None:
        """Blocking: run it in a thread."""
        try:
            os.pwrite(self._fd, data, offset)
        except OSError as exc:
            raise disk_error(exc, "write a seeded partial") from exc
        with self._lock:
            self._done.add(offset, offset + len(data))
            self._record.write(self._record.encode(self._what, self._done))

    @property
    def written(self) -> RangeSet:
        """The ranges written so far (a copy)."""
        with self._lock:
            return self._done.copy()

    def close(self) -> None:
        os.close(self._fd)
        self._record.close()


@dataclass(frozen=True, slots=True)
class OpenPartial:
    """The file a download writes into, the ranges of it a resume keeps, and its record
    (None when the disk refused one: the download completes, it just cannot resume)."""

    fd: int
    done: RangeSet
    record: ResumeRecord | None


class BlobHome(Protocol):
    """What a slot needs of the cache it downloads into (``cache.CacheStore`` has it): its
    paths, the key's lock and the publish. Named here, so slots (and the transfers that
    write into them) sit beside the store, not on top of it."""

    @property
    def layout(self) -> CacheLayout:
        """Where the partial, its record and the private temp names live."""

    def lock(self, key: str) -> BlobLock:
        """The lock on ``key`` every process using the cache shares (not yet acquired)."""

    def publish_blob(
        self, tmp: Path, sha256: str, *, identity: tuple[int, int] | None = None
    ) -> Path:
        """Move the verified ``tmp`` into the store under its sha256 (``identity``: the
        inode it must still be)."""


class Slot:
    """The download of one key into one cache; see the module docstring for its life."""

    __slots__ = ("_inode", "_private", "cache", "data", "key", "lock", "record")

    def __init__(self, cache: BlobHome, key: str) -> None:
        self.cache = cache
        self.key = key
        self.data, self.record = cache.layout.partial(key)
        self.lock = cache.lock(key)
        self._private: Path | None = None  # this download's own name for its file
        self._inode: tuple[int, int] | None = None  # of the file that name was given to

    async def __aenter__(self) -> Slot:
        await self.lock.acquire()
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.suspend()  # what was made and not published goes (a copy its origin refused)
        self.lock.release()

    # -- for the fetcher ----------------------------------------------------------------

    def open(self, what: Resumable) -> OpenPartial:
        """The file to download ``what`` into: the partial with the ranges its record proves
        are of this object, or a new file of ``what.size`` bytes with none.

        The file has two names: the shared partial (where a later run resumes) and a private
        one in ``tmp/`` (published from once verified). A new file is made under a temp name
        and renamed over the partial: truncating in place would zero a published blob's
        second name left by a crash inside publishing, or, where locks do not work, a file
        another process still writes. The private name means that such a process replacing
        the partial never takes the verified file from under us.
        """
        done = self._resume_point(what)
        fd = self._open_to_resume() if done.total() > 0 else None
        resumed = fd is not None
        if fd is None:
            fd, done = self._create(what.size), RangeSet()
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)
        return OpenPartial(fd, done, self._open_record(what, done, resume=resumed))

    def seed(self, size: int, sha256: str) -> Seeding | None:
        """A new partial of ``size`` bytes to fill with bytes of the blob ``sha256`` that came
        from elsewhere (a dead claim holder's parts in the fleet's tier), bound to the content
        alone: the download that resumes it checks the whole file's sha256, so a wrong seeded
        byte costs one download from the origin, never a wrong blob. None when a partial is
        already here (it resumes on its own) or the disk refuses a record."""
        if os.path.lexists(self.data):
            return None
        fd = self._create(size)
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)
        what = Resumable(None, None, size, sha256)
        record = self._open_record(what, RangeSet(), resume=False)
        self.suspend()  # the partial's one name is the shared one, as a resume expects
        if record is None:
            os.close(fd)
            self.abandon()
            return None
        return Seeding(fd, record, what)

    def landed(self) -> RangeSet | None:
        """What the resume record of a live download says is in the partial (it trails the
        file by at most ``sidecar_bytes``), or None if there is no record of it to trust."""
        try:
            raw = _decode_record(_read_record(self.record))
            st = self.data.lstat()
            if raw is None or not _same_inode(raw, st):
                return None
            return RangeSet.from_list(raw["done"], st.st_size)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def read(self, offset: int, n: int) -> bytes:
        """``n`` bytes of the partial from ``offset`` (blocking: run it in a thread)."""
        fd = os.open(self.data, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            return os.pread(fd, n, offset)
        finally:
            os.close(fd)

    def copy_from(self, source: Path, version: str | None) -> VerifiedFile:
        """Copy ``source`` into a new private file, hashing (sha256 and xxh3) in the same
        pass, for an origin that copies rather than downloads (blocking: run it in a
        thread). A copy is never resumed: a failed one leaves nothing; commit it like a
        download. ``version`` is what the origin said the file was before the copy."""
        path = self._new_private("copy")
        try:
            with source.open("rb") as src, path.open("xb") as out:
                st = os.fstat(out.fileno())
                self._inode = (st.st_dev, st.st_ino)
                digest = Digest().read(src, copy_to=out)
        except BaseException as exc:
            self.suspend()
            if isinstance(exc, OSError):
                then = "the copy was discarded and is made again on the next run"
                raise disk_error(exc, f"copy {source} into the cache", then=then) from exc
            raise
        return VerifiedFile(
            path=path,
            size=digest.nbytes,
            sha256=digest.sha256,
            xxh3_128=digest.xxh3_128,
            etag=version,
            verified="tofu",
            downloaded=0,
            resumed=0,
            source="local",
        )

    def verified(self) -> Path:
        """The private name of the file just written (what a ``VerifiedFile`` points at)."""
        if self._private is None:
            raise RuntimeError("open or create the slot first")
        return self._private

    def suspend(self) -> None:
        """This attempt ends unverified: drop the private name, keep the partial and its
        record for a resume."""
        private, self._private = self._private, None
        if private is not None:
            private.unlink(missing_ok=True)

    def abandon(self) -> None:
        """Discard the partial and its record: the next ``open`` starts from zero."""
        self.suspend()
        for path in (self.record, self.data):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # -- for the engine -----------------------------------------------------------------

    def commit(self, file: VerifiedFile) -> Path:
        """Publish ``file`` into the store, then forget the download's names: in this order,
        in one call, so a cancellation of its caller cannot split them (run it in a thread).
        Published, or discarded after a failed ``fsync`` (its pages may be gone), the file
        is never resumed; any other failure (a full disk making the store's folder or link)
        keeps the partial whole for the next run, as its error says."""
        try:
            if file.path != self._private:
                raise CacheError(f"{file.path} is not the file this slot wrote")
            published = self.cache.publish_blob(file.path, file.sha256, identity=self._inode)
        finally:
            # ``publish_blob`` removes the private name once published or discarded
            if self._private is not None and os.path.lexists(self._private):
                self.suspend()
            else:
                self._forget()
        if self.key != file.sha256 and file.etag is not None:
            self._remember(file)
        return published

    def drop_leftover(self) -> None:
        """A crash between publishing's link and its unlink leaves the partial of a blob that
        is in the store now: remove it, unless a live download holds the lock."""
        if not any(os.path.lexists(p) for p in (self.data, self.record)):
            return
        if self.lock.try_acquire():
            try:
                for path in (self.data, self.record):
                    path.unlink(missing_ok=True)
            finally:
                self.lock.release()

    # -- inside -------------------------------------------------------------------------

    def _remember(self, file: VerifiedFile) -> None:
        """Note which blob this key's file became, at which version of the origin's: no
        sha256 named it before it was read (a plain URL, a local copy, an object store's
        CRC), so a run killed after publishing it, or failed on another file, had nothing
        to find it by and downloaded it again. A hint, checked against the origin's version
        before use: written without fsync, and a note that cannot be written is skipped."""
        note = {
            "sha256": file.sha256,
            "size": file.size,
            "xxh3_128": file.xxh3_128,
            "verified": file.verified,
            "version": file.etag,
        }
        temp = self.cache.layout.path(*layout.TMP, temp_name("resume"))
        with contextlib.suppress(OSError):
            temp.write_bytes(json.dumps(note).encode())
            os.replace(temp, _note_path(self.cache.layout, self.key))
        with contextlib.suppress(OSError):
            temp.unlink()

    def _forget(self) -> None:
        """Remove the download's names but the store's: its private one, and the shared one
        with its resume record, unless another process (no working locks) made them anew."""
        self.suspend()
        try:
            st = os.stat(self.data, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            self.data.unlink(missing_ok=True)
            self.record.unlink(missing_ok=True)

    def _new_private(self, purpose: Literal["part", "copy"]) -> Path:
        self.suspend()
        self._private = self.cache.layout.path(*layout.TMP, temp_name(purpose))
        return self._private

    def _resume_point(self, what: Resumable) -> RangeSet:
        """Trust a partial only if it names this exact object (size, strong ETag, hash; and
        its URL where no sha256 names the content: another commit's URL of the same sha256
        serves the same bytes) and the record describes this very file (its inode), which no
        one else holds a name of: a second name is a live download's private one, or a blob
        published just before a crash. A record torn by a power loss fails its checksum and
        resumes nothing."""
        try:
            raw = _decode_record(_read_record(self.record))
            st = self.data.lstat()  # a symlink planted there is not the file it names
            seeded = raw is not None and raw.get("url") is None and what.sha256 is not None
            ok = (
                raw is not None
                and st.st_nlink == 1
                and _same_inode(raw, st)
                and raw.get("version") == _RECORD_VERSION
                and raw.get("size") == what.size
                and raw.get("sha256") == what.sha256
                and st.st_size == what.size
                and (
                    seeded  # bound to the content: the final sha256 checks every seeded byte
                    or (
                        (what.sha256 is not None or raw.get("url") == what.url)
                        and what.etag is not None
                        and raw.get("etag") == what.etag
                    )
                )
            )
            if ok and raw is not None:
                return RangeSet.from_list(raw["done"], what.size)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return RangeSet()

    def _open_to_resume(self) -> int | None:
        """Open the partial and link it to a new private name; None (start afresh) if it
        changed meanwhile or is not a regular file of ours (a planted symlink is never
        followed)."""
        try:
            _make_writable(self.data)
            fd = os.open(self.data, _FLAGS | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise disk_error(exc, f"open {self.data}") from exc
        private = self._new_private("part")
        try:
            os.link(self.data, private, follow_symlinks=False)
            here, there = os.fstat(fd), os.stat(private)
            if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
                return fd
            self.suspend()
        except FileNotFoundError:
            pass
        except OSError as exc:
            os.close(fd)
            raise disk_error(exc, f"link {self.data}") from exc
        os.close(fd)
        return None

    def _create(self, size: int) -> int:
        private = self._new_private("part")
        shared = self.cache.layout.path(*layout.TMP, temp_name("link"))
        try:
            fd = os.open(private, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise disk_error(exc, f"create {private}") from exc
        try:
            os.ftruncate(fd, size)
            os.link(private, shared)
            os.replace(shared, self.data)
        except OSError as exc:
            os.close(fd)
            self.suspend()
            shared.unlink(missing_ok=True)
            raise disk_error(exc, f"create {self.data}") from exc
        return fd

    def _open_record(self, what: Resumable, done: RangeSet, *, resume: bool) -> ResumeRecord | None:
        """The record of a resumed partial, or a new one holding its first version, renamed
        over the old (which belongs to the file the new partial replaced), so a record is
        never empty. None if the disk refuses."""
        assert self._inode is not None
        if resume:
            try:
                fd = os.open(self.record, _FLAGS | os.O_NOFOLLOW)
            except OSError:
                pass
            else:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    record = ResumeRecord(fd, self._inode)
                    record.length = st.st_size
                    return record
                os.close(fd)
        tmp = self.cache.layout.path(*layout.TMP, temp_name("resume"))
        try:
            fd = os.open(tmp, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:
            return None
        record = ResumeRecord(fd, self._inode)
        try:
            os.pwrite(fd, record.encode(what, done), 0)
            os.replace(tmp, self.record)
        except OSError:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            return None
        return record


def _make_writable(path: Path) -> None:
    """A crash between publishing's ``chmod 0444`` and its link leaves a read-only partial
    (its record still valid): make it writable again, or every open but root's fails."""
    with contextlib.suppress(FileNotFoundError):
        if not os.lstat(path).st_mode & 0o200:
            os.chmod(path, 0o644)


def _same_inode(raw: dict[str, Any], st: os.stat_result) -> bool:
    """Whether a record describes this very file: its inode, not its device number, which
    names this boot's enumeration (NVMe, ``dm-N``, NFS) and the record shares its folder."""
    inode = raw.get("inode")
    return isinstance(inode, list) and len(inode) == 2 and inode[1] == st.st_ino


def _record_check(fields: dict[str, object]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh64_hexdigest(canonical)


def _decode_record(data: bytes) -> dict[str, Any] | None:
    raw = strict_json.loads(data)
    if not isinstance(raw, dict):
        return None
    check = raw.pop("check", None)
    return raw if check == _record_check(raw) else None


def _read_record(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, _MAX_RECORD)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- every slot


def in_progress(where: CacheLayout) -> dict[str, tuple[Path, ...]]:
    """Every slot with files on disk, by key: its partial and resume record, as found."""
    directory = where.path(*layout.PARTIAL)
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as exc:
        raise disk_error(exc, f"list {directory}") from exc
    found: dict[str, tuple[Path, ...]] = {}
    for name in names:
        key, dot, ext = name.rpartition(".")
        if dot and key and f".{ext}" in _SUFFIXES:
            found[key] = (*found.get(key, ()), directory / name)
    return found


def _note_path(where: CacheLayout, key: str) -> Path:
    return where.partial(key)[0].with_suffix(".done")


def remembered(where: CacheLayout, key: str, path: str) -> FileRecord | None:
    """What ``key``'s last download became (``Slot._remember``), as a record of ``path``
    whose ``origin_etag`` is the origin's version then; None without a readable note."""
    try:
        raw = strict_json.loads(_note_path(where, key).read_bytes()[:_MAX_RECORD])
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    sha256, xxh, size = raw.get("sha256"), raw.get("xxh3_128"), raw.get("size")
    verified, version = raw.get("verified"), raw.get("version")
    if not (
        is_sha256(sha256)
        and is_xxh3_128(xxh)
        and type(size) is int
        and size >= 0
        and verified in get_args(Verification)
        and isinstance(version, str)
    ):
        return None
    how = cast(Verification, verified)
    return FileRecord(path, size, sha256, xxh, sha256, how, origin_etag=version)


def forget_gone_blobs(where: CacheLayout) -> None:
    """Drop the notes (``Slot._remember``) whose blob the store no longer holds, or that
    cannot be read: a note is worth only its blob, and a prune is what removes blobs."""
    directory = where.path(*layout.PARTIAL)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        key, dot, ext = name.rpartition(".")
        if not (dot and ext == "done"):
            continue
        note = remembered(where, key, name)
        if note is None or not where.blob(note.sha256).exists():
            with contextlib.suppress(OSError):
                (directory / name).unlink()


def remove_abandoned(cache: BlobHome, key: str, cutoff: float) -> bool:
    """Remove one slot's files untouched since ``cutoff``, under its lock; False when they
    stay (a download holds it, or wrote since, or the key is not one shardsync makes)."""
    try:
        slot = Slot(cache, key)
    except CacheError:
        return False
    if not slot.lock.try_acquire():
        return False
    try:
        for path in (slot.data, slot.record):
            with contextlib.suppress(FileNotFoundError):
                if os.lstat(path).st_mtime >= cutoff:
                    return False  # written since the scan: a download resumed it
        for path in (slot.record, slot.data):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                raise disk_error(exc, f"remove {path}") from exc
    finally:
        slot.lock.release()
    return True
