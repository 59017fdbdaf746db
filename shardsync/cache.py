"""The content-addressed cache: the only module that writes under the cache root.

Layout of a cache root ``R``::

    R/VERSION, R/CACHEDIR.TAG
    R/store/sha256/<aa>/<sha256>              immutable blobs (0o444), named by their content
    R/hub/models--{org}--{name}/              Hugging Face hub layout (HF_HUB_CACHE=R/hub works)
        blobs/<etag>                          hard link to the store blob: bytes are stored once
        snapshots/<commit>/<path>             relative symlink to ../../blobs/<etag>
        refs/<revision>                       the bare commit hash
    R/other/{kind}--{slug}/                   same layout for plain-URL and local origins
    R/state/snapshots/<repo>/<commit>.json    snapshot record, written last: it means "complete"
    R/state/access.log, R/state/leases/       last use of each snapshot; who uses one now (usage.py)
    R/quarantine/                             corrupt blobs moved out of the store by verify
    R/partial/<key>.part, <key>.json          in-progress downloads (the fetcher owns the format)
    R/locks/<key>.lock                        flock(2) locks
    R/tmp/                                    temp names for atomic replace

Why it is shaped this way:

* every entry appears through ``os.replace`` or ``os.link`` of a fully written temp file that
  lives in ``R/tmp`` (never inside the hub view, where Hugging Face readers would see it), so a
  crash leaves the old state or the new one, never a torn file;
* directories below the root are opened one component at a time with ``O_NOFOLLOW`` and every
  write goes through those directory descriptors, so a symlink planted inside the cache can
  never redirect a write outside it;
* locks are ``flock`` on an open file description: the kernel drops a dead holder's lock, so a
  crashed process never blocks the next one, and correctness never depends on the locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from shardsync.errors import CacheError, ConfigError, DiskFullError
from shardsync.manifest import validate_name
from shardsync.names import check_commit, check_etag, check_sha256, is_commit, split_revision
from shardsync.records import RepoRef, SnapshotRecord

__all__ = [
    "LAYOUT_VERSION",
    "BlobLock",
    "CacheStore",
    "Quarantined",
]

LAYOUT_VERSION = 1
"""The on-disk layout version written to ``R/VERSION``; another number is refused."""

_CACHEDIR_TAG = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This file is a cache directory tag created by shardsync.\n"
    b"# For information about cache directory tags see https://bford.info/cachedir/\n"
)
_LAYOUT_DIRS: tuple[tuple[str, ...], ...] = (
    ("store", "sha256"),
    ("hub",),
    ("other",),
    ("state", "snapshots"),
    ("partial",),
    ("locks",),
    ("tmp",),
)
_DIR_MODE = 0o755
_FILE_MODE = 0o644
_BLOB_MODE = 0o444
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SMALL_FILE = 64 * 1024 * 1024
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.ELOOP})

_KEY_RE = re.compile(r"[a-z0-9_-]{1,128}")
_DOWNLOAD_LOCK_RE = re.compile(r"(?:[0-9a-f]{64}|p-[0-9a-f]{40})\.lock")
_DIRNAME_RE = re.compile(r"(?:models|url|local)--[A-Za-z0-9._-]{1,240}")
_STATE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_JUNK_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


# --------------------------------------------------------------------------- validation


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise CacheError(f"invalid cache key {key!r}: expected [a-z0-9_-]{{1,128}}")
    return key


def _check_relpath(relpath: str) -> tuple[str, ...]:
    """Split a repository file name into path segments, after the manifest's own checks:
    the name came from the network, and this is where it becomes a path."""
    return tuple(validate_name(relpath).split("/"))


def _check_dirname(dirname: str) -> str:
    """A repo folder name as ``RepoRef.dirname`` makes them; returns its area (hub/other)."""
    if not isinstance(dirname, str) or not _DIRNAME_RE.fullmatch(dirname):
        raise CacheError(f"not a repo folder name: {dirname!r}")
    return "hub" if dirname.startswith("models--") else "other"


def _check_state_parts(parts: Sequence[str]) -> tuple[str, ...]:
    if not 0 < len(parts) <= 2 or not all(
        isinstance(p, str) and _STATE_NAME_RE.fullmatch(p) for p in parts
    ):
        raise CacheError(f"invalid state file name {'/'.join(map(str, parts))!r}")
    if parts[0] == "snapshots":
        raise CacheError("snapshot records are written by write_snapshot_record only")
    return tuple(parts)


def _list_names(path: Path) -> list[str]:
    """Entry names of a directory (sorted), or none when it is missing or not a directory."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise _os_error(exc, path, "list") from exc


def _blob_target(parts: Sequence[str], etag: str) -> str:
    """The relative symlink text from ``snapshots/<commit>/<parts>`` to ``blobs/<etag>``."""
    return "../" * (len(parts) + 1) + "blobs/" + etag


def _os_error(exc: OSError, path: Path | str, action: str) -> CacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"no space left on the device while trying to {action} {path}; "
            "partial downloads were kept for the next run"
        )
    return CacheError(f"cannot {action} {path}: {exc.strerror or exc}")


_HOST_TAG = hashlib.sha256(os.uname().nodename.encode()).hexdigest()[:8]
_TEMP_RE = re.compile(
    r"(?P<purpose>[a-z]+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]{1,10})\.[0-9a-f]{16}"
)


def temp_name(purpose: str) -> str:
    """A name under ``tmp/`` that says who made it (host, pid), so the next run on this host
    can tell a crashed writer's leftovers from a live writer's files (``sweep_orphans``)."""
    return f"{purpose}.{_HOST_TAG}.{os.getpid()}.{secrets.token_hex(8)}"


def _temp_owner(name: str) -> Literal["live", "gone", "unknown"]:
    """Whether the process that made a temp name still runs (known only on its own host)."""
    found = _TEMP_RE.fullmatch(name)
    if found is None or found["host"] != _HOST_TAG:
        return "unknown"  # another host's (a shared cache): left to prune's stale age
    pid = int(found["pid"])
    if pid <= 0:
        return "unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except (PermissionError, OverflowError):
        return "live"  # under another uid
    return "live"


def is_live_temp(name: str) -> bool:
    """A ``tmp/`` entry of a running process of this host (a download's private name lives
    as long as the download): prune leaves it whatever its age."""
    return _temp_owner(name) == "live"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class Quarantined:
    """What ``CacheStore.quarantine_blob`` did."""

    path: Path | None  # where the store blob went; None when it was no longer in the store
    links: tuple[Path, ...]  # snapshot symlinks and repo blob links removed


# --------------------------------------------------------------------------- locks


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
                raise _os_error(exc, self._path, "open lock file") from exc
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
                raise _os_error(exc, self._path, "lock") from exc
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# --------------------------------------------------------------------------- the store


class CacheStore:
    """Reads and writes one cache root; see the module docstring for the layout."""

    __slots__ = ("root",)

    root: Path

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        try:
            os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
            has_version = self._check_version()
            for parts in _LAYOUT_DIRS:
                os.close(self._walk(parts))
            if not has_version:
                self._atomic_write((), "VERSION", f"{LAYOUT_VERSION}\n".encode("ascii"))
            if not os.path.lexists(self.root / "CACHEDIR.TAG"):
                self._atomic_write((), "CACHEDIR.TAG", _CACHEDIR_TAG)
        except OSError as exc:
            raise _os_error(exc, self.root, "initialize the cache at") from exc

    # -- paths --------------------------------------------------------------------------

    @property
    def hub_dir(self) -> Path:
        """The folder to hand Hugging Face tools as ``HF_HUB_CACHE``."""
        return self.root / "hub"

    def repo_dir(self, repo: RepoRef) -> Path:
        return self.root.joinpath(*self._repo_parts(repo))

    def snapshot_dir(self, repo: RepoRef, commit: str) -> Path:
        return self.repo_dir(repo) / "snapshots" / check_commit(commit)

    def blob_path(self, sha256: str) -> Path:
        return self.root.joinpath(*self._store_parts(sha256), sha256)

    def partial_paths(self, key: str) -> tuple[Path, Path]:
        """(data file, resume sidecar) of an in-progress download."""
        _check_key(key)
        return self.root / "partial" / f"{key}.part", self.root / "partial" / f"{key}.json"

    def _repo_parts(self, repo: RepoRef) -> tuple[str, str]:
        return ("hub" if repo.kind == "hub" else "other", repo.dirname)

    def _store_parts(self, sha256: str) -> tuple[str, str, str]:
        return ("store", "sha256", check_sha256(sha256)[:2])

    # -- blobs --------------------------------------------------------------------------

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        path = self.blob_path(sha256)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise _os_error(exc, path, "stat") from exc
        return stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size)

    def publish_blob(
        self, tmp: Path, sha256: str, *, identity: tuple[int, int] | None = None
    ) -> Path:
        """Move a verified temp file into the store under its sha256; idempotent.

        The caller has checked size and hash of the file whose ``(st_dev, st_ino)`` is
        ``identity`` (checked again here: a file we did not verify is never linked). ``link``
        (not ``rename``) makes the final name appear only if it is absent, so an existing blob
        is never replaced, even in a race; the temp file is removed either way.
        """
        final = self.blob_path(sha256)
        try:
            with self._dir(self._store_parts(sha256)) as store_fd:
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        raise CacheError(f"cannot publish {tmp}: not a regular file")
                    if identity is not None and (st.st_dev, st.st_ino) != identity:
                        raise CacheError(f"cannot publish {tmp}: not the file that was verified")
                    try:
                        os.fsync(fd)
                    except OSError as exc:
                        # The kernel may have dropped the pages it failed to write: a read
                        # now returns bytes the disk does not hold, so this file can never be
                        # verified again (a resume would trust it). Download it anew.
                        with contextlib.suppress(OSError):
                            os.unlink(tmp)
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise DiskFullError(
                                f"no space left on the device while writing {tmp}; it was "
                                "discarded and is downloaded again on the next run"
                            ) from exc
                        raise CacheError(
                            f"cannot publish blob {sha256}: fsync of the downloaded file failed "
                            f"({exc.strerror or exc}); it was discarded and is downloaded again "
                            "on the next run"
                        ) from exc
                    os.fchmod(fd, _BLOB_MODE)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, sha256, dst_dir_fd=store_fd, follow_symlinks=False)
                except FileExistsError:
                    self._regular_file(store_fd, sha256, final)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.chmod(tmp, _FILE_MODE)  # it stays a writable partial for a resume
                    raise
                else:
                    os.fsync(store_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except OSError as exc:
            raise _os_error(exc, final, "publish blob") from exc
        return final

    def link_file(
        self, repo: RepoRef, commit: str, relpath: str, *, sha256: str, etag: str
    ) -> Path:
        """Expose a store blob as ``snapshots/<commit>/<relpath>`` of ``repo``.

        ``blobs/<etag>`` becomes a hard link to the store blob, the snapshot entry a relative
        symlink to it. Both appear by ``os.replace`` of a temp name; calling again is a no-op.
        """
        parts = _check_relpath(relpath)
        check_sha256(sha256)
        check_etag(etag)
        repo_parts = self._repo_parts(repo)
        snapshot = self.snapshot_dir(repo, commit).joinpath(*parts)
        try:
            with (
                self._dir(("tmp",)) as tmp_fd,
                self._dir((*repo_parts, "snapshots", commit, *parts[:-1])) as snap_fd,
            ):
                self._link_blob(tmp_fd, repo_parts, sha256, etag)
                target = _blob_target(parts, etag)
                try:
                    if os.readlink(parts[-1], dir_fd=snap_fd) == target:
                        return snapshot
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.EINVAL):
                        raise
                tmp = temp_name("symlink")
                os.symlink(target, tmp, dir_fd=tmp_fd)
                self._replace(tmp_fd, tmp, snap_fd, parts[-1])
        except OSError as exc:
            raise _os_error(exc, snapshot, "link") from exc
        return snapshot

    def _link_blob(self, tmp_fd: int, repo_parts: Sequence[str], sha256: str, etag: str) -> None:
        with (
            self._dir(self._store_parts(sha256)) as store_fd,
            self._dir((*repo_parts, "blobs")) as blobs_fd,
        ):
            try:
                src = self._regular_file(store_fd, sha256, self.blob_path(sha256))
            except FileNotFoundError as exc:
                raise CacheError(f"blob {sha256} is not in the store; publish it first") from exc
            try:
                cur = os.stat(etag, dir_fd=blobs_fd, follow_symlinks=False)
                if (cur.st_dev, cur.st_ino) == (src.st_dev, src.st_ino):
                    return
            except FileNotFoundError:
                pass
            tmp = temp_name("blob")
            os.link(sha256, tmp, src_dir_fd=store_fd, dst_dir_fd=tmp_fd, follow_symlinks=False)
            self._replace(tmp_fd, tmp, blobs_fd, etag)
            # rename(2) is a no-op when both names are already links to one file (a
            # concurrent link of the same blob): the temp name would then stay behind.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=tmp_fd)

    # -- refs and records ---------------------------------------------------------------

    def write_ref(self, repo: RepoRef, revision: str, commit: str) -> None:
        """Point ``refs/<revision>`` at ``commit``; call it after the snapshot links exist.

        Hugging Face readers resolve a branch through this file, and ``scan_cache_dir`` flags
        a ref whose snapshot folder is missing, so an unlinked commit is refused.
        """
        parts = split_revision(revision)
        check_commit(commit)
        if revision == commit:
            return
        if is_commit(revision):
            raise ConfigError(f"revision {revision!r} is a commit hash other than {commit}")
        snapshot = self.snapshot_dir(repo, commit)
        if not os.path.isdir(snapshot):
            raise CacheError(f"cannot write ref {revision!r}: {snapshot} does not exist yet")
        repo_parts = self._repo_parts(repo)
        path = self.repo_dir(repo).joinpath("refs", *parts)
        try:
            self._atomic_write((*repo_parts, "refs", *parts[:-1]), parts[-1], commit.encode())
        except OSError as exc:
            raise _os_error(exc, path, "write ref") from exc

    def read_ref(self, repo: RepoRef, revision: str) -> str | None:
        """The commit ``revision`` points to, or ``None`` when no ref is cached."""
        path = self.repo_dir(repo).joinpath("refs", *split_revision(revision))
        data = self._read_small(path)
        if data is None:
            return None
        commit = _parse_commit(data)
        if commit is None:
            raise CacheError(f"{path} does not hold a commit hash")
        return commit

    def write_snapshot_record(self, record: SnapshotRecord) -> None:
        """Mark a snapshot complete: atomic, durable, and the last write of a download.

        The view's links are made durable first (``blobs/`` and every folder of the
        snapshot), so after a power loss no record or ref names links that are gone.
        """
        data = record.to_json()
        parts = ("state", "snapshots", record.repo.dirname)
        name = f"{record.commit}.json"
        try:
            self._sync_view(record.repo, record.commit)
            self._atomic_write(parts, name, data)
        except OSError as exc:
            raise _os_error(exc, self.root.joinpath(*parts, name), "write") from exc

    def _sync_view(self, repo: RepoRef, commit: str) -> None:
        repo_parts = self._repo_parts(repo)
        fd = self._walk_existing((*repo_parts, "blobs"))
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        top = self.snapshot_dir(repo, check_commit(commit))
        for folder, _dirs, _files in os.walk(top):
            fd = os.open(folder, _DIR_FLAGS)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read_snapshot_record(self, repo: RepoRef, commit: str) -> SnapshotRecord | None:
        path = self._record_path(repo, commit)
        data = self._read_small(path)
        if data is None:
            return None
        record = SnapshotRecord.from_json(data)
        if record.repo != repo or record.commit != commit:
            raise CacheError(f"{path} describes another snapshot")
        return record

    def find_complete(self, repo: RepoRef, revision: str) -> SnapshotRecord | None:
        """The record of a complete snapshot for ``revision``, or ``None``.

        Complete means: the record exists and parses, and every file's snapshot link points
        at its blob, which is a regular file of the recorded size. Only ``stat`` calls, no
        hashing. A corrupt ref or record counts as absent, so the next download rewrites it.
        """
        if is_commit(revision):
            commit: str | None = revision
        else:
            ref = self._read_small(self.repo_dir(repo).joinpath("refs", *split_revision(revision)))
            commit = None if ref is None else _parse_commit(ref)
        if commit is None:
            return None
        data = self._read_small(self._record_path(repo, commit))
        if data is None:
            return None
        try:
            record = SnapshotRecord.from_json(data)
        except CacheError:
            return None
        if record.repo != repo or record.commit != commit:
            return None
        snapshot = self.snapshot_dir(repo, commit)
        for f in record.files:
            parts = f.path.split("/")
            link = snapshot.joinpath(*parts)
            try:
                if os.readlink(link) != _blob_target(parts, f.etag):
                    return None
                st = os.stat(link)
            except OSError as exc:
                if exc.errno in _MISSING_ERRNOS:
                    return None
                raise _os_error(exc, link, "stat") from exc
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return None
        return record

    def _record_path(self, repo: RepoRef, commit: str) -> Path:
        return self.root / "state" / "snapshots" / repo.dirname / f"{check_commit(commit)}.json"

    # -- locks --------------------------------------------------------------------------

    def lock(self, key: str, *, shared: bool = False) -> BlobLock:
        """A lock on ``key`` shared by every process using this cache (not yet acquired)."""
        _check_key(key)
        try:
            os.close(self._walk(("locks",)))
        except OSError as exc:
            raise _os_error(exc, self.root / "locks", "create") from exc
        return BlobLock(self.root / "locks" / f"{key}.lock", shared=shared)

    def _list_area(self, area: str) -> list[str]:
        """The names in a top-level folder of the cache; none when it does not exist."""
        try:
            return os.listdir(self.root / area)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _os_error(exc, self.root / area, "list") from exc

    def remove_idle_locks(self) -> int:
        """Unlink the lock files of downloads nobody holds (one per blob ever fetched would
        pile up otherwise); how many went. Each is removed while held (see ``BlobLock``)."""
        names = self._list_area("locks")
        removed = 0
        for name in names:
            if not _DOWNLOAD_LOCK_RE.fullmatch(name):
                continue  # the prune gate and the access log's lock stay
            lock = BlobLock(self.root / "locks" / name)
            if not lock.try_acquire():
                continue
            try:
                os.unlink(lock.path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _os_error(exc, lock.path, "remove") from exc
            finally:
                lock.release()
        return removed

    # -- lifecycle: state files, eviction, quarantine (used by usage, pruner, verify) ------

    def state_path(self, *parts: str) -> Path:
        """``state/<parts...>``: where leases (``leases/<id>.json``) and the access log live."""
        return self.root.joinpath("state", *_check_state_parts(parts))

    def write_state_file(self, *parts: str, data: bytes) -> None:
        """Atomically replace ``state/<parts...>`` (leases, the compacted access log)."""
        names = _check_state_parts(parts)
        try:
            self._atomic_write(("state", *names[:-1]), names[-1], data)
        except OSError as exc:
            raise _os_error(exc, self.root.joinpath("state", *names), "write") from exc

    def append_state_file(self, *parts: str, data: bytes) -> int:
        """Append ``data`` to ``state/<parts...>`` with one ``O_APPEND`` write; returns the new
        size. Not fsynced: an access record lost in a crash only makes a snapshot look older."""
        names = _check_state_parts(parts)
        path = self.root.joinpath("state", *names)
        try:
            with self._dir(("state", *names[:-1])) as dir_fd:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(names[-1], flags, _FILE_MODE, dir_fd=dir_fd)
                try:
                    _write_all(fd, data)
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
        except OSError as exc:
            raise _os_error(exc, path, "append to") from exc

    def touch_state_file(self, *parts: str) -> bool:
        """Set the mtime of ``state/<parts...>`` to now (a lease heartbeat); False if absent."""
        names = _check_state_parts(parts)
        path = self.root.joinpath("state", *names)
        try:
            fd = self._walk_existing(("state", *names[:-1]))
            if fd is None:
                return False
            try:
                os.utime(names[-1], dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(exc, path, "touch") from exc
        return True

    def remove_state_file(self, *parts: str) -> bool:
        """Unlink ``state/<parts...>``; False when it was already gone."""
        names = _check_state_parts(parts)
        try:
            return self._unlink_at(("state", *names[:-1]), names[-1])
        except OSError as exc:
            raise _os_error(exc, self.root.joinpath("state", *names), "remove") from exc

    def snapshot_records(self) -> Iterator[tuple[str, str, SnapshotRecord | None]]:
        """Every ``(repo dirname, commit, record)`` under ``state/snapshots``. The record is
        None when the file does not parse or describes another snapshot (it counts as absent)."""
        base = self.root / "state" / "snapshots"
        for dirname in _list_names(base):
            if not _DIRNAME_RE.fullmatch(dirname):
                continue
            for name in _list_names(base / dirname):
                commit, _, ext = name.partition(".")
                if ext != "json" or not is_commit(commit):
                    continue
                data = self._read_small(base / dirname / name)
                if data is None:
                    continue  # removed since the listing
                try:
                    record: SnapshotRecord | None = SnapshotRecord.from_json(data)
                except CacheError:
                    record = None
                if record is not None and (
                    record.repo.dirname != dirname or record.commit != commit
                ):
                    record = None
                yield dirname, commit, record

    def repo_dir_of(self, dirname: str) -> Path:
        """The repo folder called ``dirname`` (``models--org--name``, ``url--...``, ...)."""
        return self.root.joinpath(_check_dirname(dirname), dirname)

    def evict_snapshot(self, dirname: str, commit: str) -> None:
        """Take one snapshot out of the cache in the order readers can bear.

        First every ref naming the commit (Hugging Face readers stop resolving to it), then its
        completeness record (shardsync stops trusting it), then its folder, which leaves the
        view in one ``rename`` into ``tmp/`` and is emptied there. Blobs are not touched here:
        the caller unlinks ``blobs/<etag>`` and store blobs afterwards, once nothing it keeps
        refers to them.
        """
        area = _check_dirname(dirname)
        check_commit(commit)
        path = self.repo_dir_of(dirname) / "snapshots" / commit
        try:
            self._remove_refs_to((area, dirname, "refs"), commit)
            self._unlink_at(("state", "snapshots", dirname), f"{commit}.json")
            self._discard((area, dirname, "snapshots"), commit)
        except OSError as exc:
            raise _os_error(exc, path, "evict") from exc

    def remove_repo_blob(self, dirname: str, etag: str) -> bool:
        """Unlink ``blobs/<etag>`` of a repo (a hard link: the store keeps its own name)."""
        area = _check_dirname(dirname)
        check_etag(etag)
        try:
            return self._unlink_at((area, dirname, "blobs"), etag)
        except OSError as exc:
            raise _os_error(exc, self.repo_dir_of(dirname) / "blobs" / etag, "remove") from exc

    def remove_repo_if_empty(self, dirname: str) -> bool:
        """Remove a repo folder that holds no snapshot, blob or ref file any more.

        It leaves in one ``rename`` (``scan_cache_dir`` flags a repo without ``snapshots/``,
        so it must never be seen half removed); anything else inside (a Hugging Face download
        in progress, ``.no_exist``) keeps it.
        """
        area = _check_dirname(dirname)
        path = self.repo_dir_of(dirname)
        try:
            parent = self._walk_existing((area,))
            if parent is None:
                return False
            try:
                if not self._repo_is_empty(parent, dirname):
                    return False
                with self._dir(("tmp",)) as tmp_fd:
                    tmp = temp_name("evict")
                    os.rename(dirname, tmp, src_dir_fd=parent, dst_dir_fd=tmp_fd)
                    os.fsync(parent)
                    shutil.rmtree(tmp, dir_fd=tmp_fd)
            finally:
                os.close(parent)
            state = self._walk_existing(("state", "snapshots"))
            if state is not None:
                try:
                    with contextlib.suppress(OSError):
                        os.rmdir(dirname, dir_fd=state)  # only when no record is left
                finally:
                    os.close(state)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise _os_error(exc, path, "remove") from exc
        return True

    def remove_blob(self, sha256: str) -> int:
        """Unlink a store blob that no repo links to any more (``st_nlink == 1``).

        Returns the bytes it occupied, 0 when it is absent or still linked. Only unlink, never
        truncate: a process that has the blob open or mapped keeps reading its bytes.
        """
        path = self.blob_path(sha256)
        try:
            fd = self._walk_existing(self._store_parts(sha256))
            if fd is None:
                return 0
            try:
                st = os.stat(sha256, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                    return 0
                os.unlink(sha256, dir_fd=fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise _os_error(exc, path, "remove") from exc
        return st.st_blocks * 512

    def remove_partial(self, key: str) -> None:
        """Unlink an abandoned download's data file and sidecar (hold its lock while calling)."""
        data, sidecar = self.partial_paths(key)
        try:
            for path in (sidecar, data):
                self._unlink_at(("partial",), path.name)
        except OSError as exc:
            raise _os_error(exc, data, "remove") from exc

    def remove_junk(self, area: Literal["tmp", "quarantine"], name: str) -> None:
        """Remove an entry of ``tmp/`` (left by a crash) or ``quarantine/`` (a corrupt blob)."""
        if area not in ("tmp", "quarantine") or not _JUNK_NAME_RE.fullmatch(name):
            raise CacheError(f"refusing to remove {area}/{name!r}")
        try:
            fd = self._walk_existing((area,))
            if fd is None:
                return
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _os_error(exc, self.root / area / name, "remove") from exc

    def sweep_orphans(self) -> int:
        """Remove ``tmp/`` entries left by crashed processes of this host; how many went.

        Safe without a lock: the writer is gone. Entries of other hosts sharing the cache
        are left to ``prune`` (``stale_partial_age``), as a pid means nothing across hosts.
        """
        names = self._list_area("tmp")
        orphans = [name for name in names if _temp_owner(name) == "gone"]
        for name in orphans:
            self.remove_junk("tmp", name)
        return len(orphans)

    def unlink_snapshot_file(self, dirname: str, commit: str, relpath: str) -> bool:
        """Remove one file's symlink from a snapshot, which makes the snapshot incomplete (the
        next download links it again); False when it was already gone."""
        area = _check_dirname(dirname)
        parts = _check_relpath(relpath)
        path = self.repo_dir_of(dirname).joinpath("snapshots", check_commit(commit), *parts)
        try:
            return self._unlink_at((area, dirname, "snapshots", commit, *parts[:-1]), parts[-1])
        except OSError as exc:
            raise _os_error(exc, path, "remove") from exc

    def quarantine_blob(self, sha256: str, inode: tuple[int, int] | None = None) -> Quarantined:
        """Take a corrupt blob out of every view, so no reader gets its bytes from us again.

        The store blob moves to ``quarantine/`` first (``has_blob`` turns false, so the next
        download fetches it again); then every snapshot symlink to a repo ``blobs/<etag>`` that
        is the same inode goes (``find_complete`` says incomplete from then on, and Hugging Face
        readers find no file rather than bad bytes), then those hard links. Records stay: their
        other files are still right, and the next download reuses them by these hints.
        ``inode`` (st_dev, st_ino) is the file found corrupt: a store blob that is another inode
        by now was published again and stays.
        """
        check_sha256(sha256)
        moved: Path | None = None
        try:
            target = inode
            store = self._walk_existing(self._store_parts(sha256))
            if store is not None:
                try:
                    st = os.stat(sha256, dir_fd=store, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and inode in (None, (st.st_dev, st.st_ino)):
                        target = (st.st_dev, st.st_ino)
                        with self._dir(("quarantine",)) as q_fd:
                            name = f"{sha256}.{time.time_ns()}"
                            os.rename(sha256, name, src_dir_fd=store, dst_dir_fd=q_fd)
                            os.fsync(q_fd)
                            os.fsync(store)
                            moved = self.root / "quarantine" / name
                except FileNotFoundError:
                    pass
                finally:
                    os.close(store)
            links: list[Path] = []
            if target is not None:
                for area, dirname in self._repo_dirs():
                    links.extend(self._unlink_inode_links(area, dirname, target))
        except OSError as exc:
            raise _os_error(exc, self.blob_path(sha256), "quarantine") from exc
        return Quarantined(moved, tuple(links))

    def _unlink_inode_links(self, area: str, dirname: str, inode: tuple[int, int]) -> list[Path]:
        """Snapshot symlinks to, then the repo blob links of, one inode inside one repo."""
        repo = self.root / area / dirname
        blobs = self._walk_existing((area, dirname, "blobs"))
        if blobs is None:
            return []
        try:
            etags = set()
            for name in os.listdir(blobs):
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(name, dir_fd=blobs, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) == inode:
                        etags.add(name)
            if not etags:
                return []
            removed = []
            snaps = self._walk_existing((area, dirname, "snapshots"))
            if snaps is not None:
                try:
                    for top, _dirs, files, top_fd in os.fwalk(".", dir_fd=snaps):
                        for name in files:
                            with contextlib.suppress(OSError):
                                target = os.readlink(name, dir_fd=top_fd)
                                head, _, etag = target.rpartition("/")
                                if etag in etags and head.endswith("blobs"):
                                    os.unlink(name, dir_fd=top_fd)
                                    removed.append(repo / "snapshots" / top / name)
                finally:
                    os.close(snaps)
            for etag in sorted(etags):
                if self._unlink_at((area, dirname, "blobs"), etag):
                    removed.append(repo / "blobs" / etag)
            return removed
        finally:
            os.close(blobs)

    def _repo_dirs(self) -> Iterator[tuple[str, str]]:
        for area in ("hub", "other"):
            for name in _list_names(self.root / area):
                if _DIRNAME_RE.fullmatch(name):
                    yield area, name

    def _repo_is_empty(self, parent: int, dirname: str) -> bool:
        repo = os.open(dirname, _DIR_FLAGS, dir_fd=parent)
        try:
            names = set(os.listdir(repo))
            if not names <= {"blobs", "refs", "snapshots"}:
                return False
            for sub in sorted(names):
                fd = os.open(sub, _DIR_FLAGS, dir_fd=repo)
                try:
                    if any(files for _top, _dirs, files, _fd in os.fwalk(".", dir_fd=fd)):
                        return False
                    if sub != "refs" and os.listdir(fd):
                        return False
                finally:
                    os.close(fd)
        finally:
            os.close(repo)
        return True

    def _remove_refs_to(self, parts: Sequence[str], commit: str) -> None:
        refs = self._walk_existing(parts)
        if refs is None:
            return
        try:
            removed = False
            for _top, _dirs, files, top_fd in os.fwalk(".", dir_fd=refs):
                for name in files:
                    try:
                        fd = os.open(
                            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top_fd
                        )
                    except OSError:
                        continue
                    with os.fdopen(fd, "rb") as f:
                        data = f.read(256)
                    if _parse_commit(data) == commit:
                        os.unlink(name, dir_fd=top_fd)
                        removed = True
                        os.fsync(top_fd)  # no ref may outlive the snapshot it names
            if removed:
                os.fsync(refs)
        finally:
            os.close(refs)

    def _discard(self, parts: Sequence[str], name: str) -> None:
        """Move ``parts/name`` into ``tmp/`` in one rename, then delete it there."""
        parent = self._walk_existing(parts)
        if parent is None:
            return
        try:
            with self._dir(("tmp",)) as tmp_fd:
                tmp = temp_name("evict")
                try:
                    os.rename(name, tmp, src_dir_fd=parent, dst_dir_fd=tmp_fd)
                except FileNotFoundError:
                    return
                os.fsync(parent)
                shutil.rmtree(tmp, dir_fd=tmp_fd)
        finally:
            os.close(parent)

    def _unlink_at(self, parts: Sequence[str], name: str) -> bool:
        fd = self._walk_existing(parts)
        if fd is None:
            return False
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return True

    def _walk_existing(self, parts: Sequence[str]) -> int | None:
        """Like ``_walk`` but creating nothing: None when a component is missing."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            for depth in range(len(parts)):
                child = self._open_dir_at(fd, parts[: depth + 1])
                os.close(fd)
                fd = child
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- low level ----------------------------------------------------------------------

    def _check_version(self) -> bool:
        """Whether ``VERSION`` exists; refuses a cache of another layout version."""
        path = self.root / "VERSION"
        data = self._read_small(path)
        if data is None:
            return False
        text = data.decode("ascii", "replace").strip()
        if not text.isdigit():
            raise CacheError(f"{path} is corrupt: {text[:40]!r}")
        if int(text) != LAYOUT_VERSION:
            raise CacheError(
                f"the cache at {self.root} has layout version {int(text)}; "
                f"this shardsync reads version {LAYOUT_VERSION} only"
            )
        return True

    def _read_small(self, path: Path) -> bytes | None:
        """Read a small file without following a symlink at its name; None when absent."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise _os_error(exc, path, "read") from exc
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_SMALL_FILE + 1)
        except OSError as exc:
            raise _os_error(exc, path, "read") from exc
        if len(data) > _MAX_SMALL_FILE:
            raise CacheError(f"{path} is larger than {_MAX_SMALL_FILE} bytes")
        return data

    def _walk(self, parts: Sequence[str]) -> int:
        """Open ``root/parts...`` as a directory fd, one component at a time and never through
        a symlink, creating missing components (0o755) on the way."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth in range(len(parts)):
                child = self._open_child(fd, parts[: depth + 1])
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_child(self, parent: int, rel: Sequence[str]) -> int:
        try:
            return self._open_dir_at(parent, rel)
        except FileNotFoundError:
            pass
        try:
            os.mkdir(rel[-1], _DIR_MODE, dir_fd=parent)
        except FileExistsError:
            return self._open_dir_at(parent, rel)
        child = self._open_dir_at(parent, rel)
        try:
            os.fchmod(child, _DIR_MODE)  # the umask must not narrow a shared cache
            os.fsync(parent)  # the new entry must survive a crash like the files inside it
        except BaseException:
            os.close(child)
            raise
        return child

    def _open_dir_at(self, parent: int, rel: Sequence[str]) -> int:
        try:
            return os.open(rel[-1], _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise CacheError(
                    f"refusing to use {self.root.joinpath(*rel)}: it is a symlink or not a "
                    "directory, and the cache never writes through a symlink"
                ) from exc
            raise

    @contextlib.contextmanager
    def _dir(self, parts: Sequence[str]) -> Iterator[int]:
        fd = self._walk(parts)
        try:
            yield fd
        finally:
            os.close(fd)

    def _regular_file(self, dir_fd: int, name: str, path: Path) -> os.stat_result:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"refusing to use {path}: not a regular file")
        return st

    @staticmethod
    def _replace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        try:
            os.replace(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(src, dir_fd=src_fd)
            raise

    def _atomic_write(self, parts: Sequence[str], name: str, data: bytes) -> None:
        """Write ``root/parts/name`` via a fsynced temp file, ``os.replace`` and a dir fsync."""
        with self._dir(("tmp",)) as tmp_fd, self._dir(parts) as dir_fd:
            tmp = temp_name("write")
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, _FILE_MODE, dir_fd=tmp_fd)
            try:
                try:
                    _write_all(fd, data)
                    os.fchmod(fd, _FILE_MODE)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=tmp_fd)
                raise
            self._replace(tmp_fd, tmp, dir_fd, name)
            os.fsync(dir_fd)


def _parse_commit(data: bytes) -> str | None:
    text = data.decode("ascii", "replace").strip()
    return text if is_commit(text) else None
