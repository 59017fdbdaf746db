"""The content-addressed cache: the only module that writes under the cache root.

Every name under the root comes from ``layout.py``; in-progress downloads (``partial/``,
their locks and private temp names) are ``slot.py``'s.

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

import contextlib
import errno
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from shardsync import layout
from shardsync.errors import CacheError, ConfigError, disk_error
from shardsync.layout import (
    CacheLayout,
    Parts,
    TempPurpose,
    blob_target,
    file_parts,
    temp_name,
)
from shardsync.locks import BlobLock
from shardsync.names import check_commit, check_etag, check_sha256, is_commit, split_revision
from shardsync.records import RepoRef, SnapshotRecord

__all__ = [
    "DIR_FLAGS",
    "CacheRoot",
    "CacheStore",
    "parse_ref",
    "temp_name",
]

_DIR_MODE = 0o755
_FILE_MODE = 0o644
_BLOB_MODE = 0o444
_STATE_THEN = "nothing downloaded is lost: free space (`shardsync prune`) and run again"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_SMALL_FILE = 64 * 1024 * 1024
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EINVAL, errno.ELOOP})


def _list_names(path: Path) -> list[str]:
    """Entry names of a directory (sorted), or none when it is missing or not a directory."""
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise disk_error(exc, f"list {path}") from exc


def _mtime(path: Path) -> float:
    """When ``path`` was last written (0 when it does not exist yet)."""
    try:
        return os.lstat(path).st_mtime
    except FileNotFoundError:
        return 0.0


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --------------------------------------------------------------------------- the root


class CacheRoot:
    """Writes under one cache root without ever following a symlink: every directory below
    the root is opened one component at a time with ``O_NOFOLLOW`` and every write goes
    through those descriptors, so a symlink planted inside the cache can never redirect a
    write outside it. What the store and the removals share."""

    __slots__ = ("layout", "root")

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = CacheLayout(root)

    def list_area(self, area: Parts) -> list[str]:
        """The names in a folder of the cache; none when it does not exist."""
        return _list_names(self.layout.path(*area))

    def discard(self, parts: Sequence[str], name: str) -> None:
        """Move ``parts/name`` into ``tmp/`` in one rename, then delete it there."""
        parent = self.walk_existing(parts)
        if parent is None:
            return
        try:
            with self.dir(layout.TMP) as tmp_fd:
                tmp = temp_name("evict")
                try:
                    os.rename(name, tmp, src_dir_fd=parent, dst_dir_fd=tmp_fd)
                except FileNotFoundError:
                    return
                os.fsync(parent)
                shutil.rmtree(tmp, dir_fd=tmp_fd)
        finally:
            os.close(parent)

    def unlink_at(self, parts: Sequence[str], name: str) -> bool:
        fd = self.walk_existing(parts)
        if fd is None:
            return False
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return True

    def walk_existing(self, parts: Sequence[str]) -> int | None:
        """Like ``walk`` but creating nothing: None when a component is missing."""
        try:
            return self._descend(parts, self._open_dir_at)
        except FileNotFoundError:
            return None

    def read_small(self, path: Path) -> bytes | None:
        """Read a small file without following a symlink at its name; None when absent."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise disk_error(exc, f"read {path}") from exc
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(_MAX_SMALL_FILE + 1)
        except OSError as exc:
            raise disk_error(exc, f"read {path}") from exc
        if len(data) > _MAX_SMALL_FILE:
            raise CacheError(f"{path} is larger than {_MAX_SMALL_FILE} bytes")
        return data

    def walk(self, parts: Sequence[str]) -> int:
        """Open ``root/parts...`` as a directory fd, one component at a time and never through
        a symlink, creating missing components (0o755) on the way."""
        return self._descend(parts, self._open_child)

    def _descend(
        self, parts: Sequence[str], open_child: Callable[[int, Sequence[str]], int]
    ) -> int:
        """The fd of ``root/parts...``, each component opened by ``open_child`` from its
        parent's fd; no fd is left open when a step fails."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for depth in range(len(parts)):
                child = open_child(fd, parts[: depth + 1])
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
            return os.open(rel[-1], DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise CacheError(
                    f"refusing to use {self.root.joinpath(*rel)}: it is a symlink or not a "
                    "directory, and the cache never writes through a symlink"
                ) from exc
            raise

    @contextlib.contextmanager
    def dir(self, parts: Sequence[str]) -> Iterator[int]:
        fd = self.walk(parts)
        try:
            yield fd
        finally:
            os.close(fd)

    def regular_file(self, dir_fd: int, name: str, path: Path) -> os.stat_result:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise CacheError(f"refusing to use {path}: not a regular file")
        return st

    @staticmethod
    def replace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        try:
            os.replace(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(src, dir_fd=src_fd)
            raise

    def atomic_write(
        self, parts: Sequence[str], name: str, data: bytes, *, purpose: TempPurpose
    ) -> None:
        """Write ``root/parts/name`` via a fsynced temp file, ``os.replace`` and a dir fsync."""
        with self.dir(layout.TMP) as tmp_fd, self.dir(parts) as dir_fd:
            tmp = temp_name(purpose)
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
            self.replace(tmp_fd, tmp, dir_fd, name)
            os.fsync(dir_fd)


# --------------------------------------------------------------------------- the store


class CacheStore:
    """Reads and writes one cache root; see the module docstring for the layout."""

    __slots__ = ("fs", "layout", "root")

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.abspath(root))
        self.fs = CacheRoot(self.root)
        self.layout = self.fs.layout
        try:
            os.makedirs(self.root, mode=_DIR_MODE, exist_ok=True)
            has_version = self._check_version()
            for parts in layout.AREAS:
                os.close(self.fs.walk(parts))
            if not has_version:
                version = f"{layout.LAYOUT_VERSION}\n".encode("ascii")
                self.fs.atomic_write((), "VERSION", version, purpose="layout")
            if not os.path.lexists(self.root / "CACHEDIR.TAG"):
                self.fs.atomic_write((), "CACHEDIR.TAG", layout.CACHEDIR_TAG, purpose="layout")
        except OSError as exc:
            raise disk_error(exc, f"initialize the cache at {self.root}") from exc

    # -- paths (the layout's names, for a repo rather than its folder name) -----------------

    def blob_path(self, sha256: str) -> Path:
        return self.layout.blob(sha256)

    def snapshot_dir(self, repo: RepoRef, commit: str) -> Path:
        return self.layout.snapshot(repo.dirname, commit)

    # -- blobs --------------------------------------------------------------------------

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        path = self.blob_path(sha256)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            raise disk_error(exc, f"stat {path}") from exc
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
            with self.fs.dir(layout.blob_dir(sha256)) as store_fd:
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
                        again = "it was discarded and is downloaded again on the next run"
                        raise disk_error(exc, f"fsync {tmp}", then=again) from exc
                    os.fchmod(fd, _BLOB_MODE)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, sha256, dst_dir_fd=store_fd, follow_symlinks=False)
                except FileExistsError:
                    self.fs.regular_file(store_fd, sha256, final)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.chmod(tmp, _FILE_MODE)  # it stays a writable partial for a resume
                    raise
                else:
                    os.fsync(store_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        except OSError as exc:
            raise disk_error(exc, f"publish blob {final}") from exc
        return final

    def link_file(
        self, repo: RepoRef, commit: str, relpath: str, *, sha256: str, etag: str
    ) -> Path:
        """Expose a store blob as ``snapshots/<commit>/<relpath>`` of ``repo``.

        ``blobs/<etag>`` becomes a hard link to the store blob, the snapshot entry a relative
        symlink to it. Both appear by ``os.replace`` of a temp name; calling again is a no-op.
        """
        parts = file_parts(relpath)
        check_sha256(sha256)
        check_etag(etag)
        repo_parts = layout.repo_dir(repo.dirname)
        snapshot = self.snapshot_dir(repo, commit).joinpath(*parts)
        try:
            self._mark_making(repo, commit)
            with (
                self.fs.dir(layout.TMP) as tmp_fd,
                self.fs.dir((*repo_parts, "snapshots", commit, *parts[:-1])) as snap_fd,
            ):
                self._link_blob(tmp_fd, repo_parts, sha256, etag)
                target = blob_target(parts, etag)
                try:
                    if os.readlink(parts[-1], dir_fd=snap_fd) == target:
                        return snapshot
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.EINVAL):
                        raise
                tmp = temp_name("symlink")
                os.symlink(target, tmp, dir_fd=tmp_fd)
                self.fs.replace(tmp_fd, tmp, snap_fd, parts[-1])
        except OSError as exc:
            raise disk_error(exc, f"link {snapshot}") from exc
        return snapshot

    def _mark_making(self, repo: RepoRef, commit: str) -> None:
        """Before a snapshot's first link, mark it shardsync's, being made, until its record
        replaces the mark: one with neither is another tool's (huggingface_hub makes one for
        a pinned commit from our blobs, with no ref), never pruned as an abandoned download.
        No fsync: a mark lost to a power loss leaves a snapshot kept, not one deleted."""
        where = self.layout
        if where.record(repo.dirname, commit).exists():
            return
        with self.fs.dir((*layout.RECORDS, repo.dirname)) as fd:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            with contextlib.suppress(FileExistsError):
                os.close(os.open(layout.pending_name(commit), flags, _FILE_MODE, dir_fd=fd))

    def _link_blob(self, tmp_fd: int, repo_parts: Parts, sha256: str, etag: str) -> None:
        with (
            self.fs.dir(layout.blob_dir(sha256)) as store_fd,
            self.fs.dir((*repo_parts, "blobs")) as blobs_fd,
        ):
            try:
                src = self.fs.regular_file(store_fd, sha256, self.blob_path(sha256))
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
            self.fs.replace(tmp_fd, tmp, blobs_fd, etag)
            # rename(2) is a no-op when both names are already links to one file (a
            # concurrent link of the same blob): the temp name would then stay behind.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=tmp_fd)

    # -- refs and records ---------------------------------------------------------------

    def write_ref(
        self, repo: RepoRef, revision: str, commit: str, resolved_at: float | None = None
    ) -> None:
        """Point ``refs/<revision>`` at ``commit``; call it after the snapshot links exist.

        Hugging Face readers resolve a branch through this file, and ``scan_cache_dir`` flags
        a ref whose snapshot folder is missing, so an unlinked commit is refused.
        ``resolved_at``: when ``revision`` was found to be ``commit``, kept as the ref's mtime.
        A ref read later (a job that started after this one and ended before it, the branch
        moved meanwhile) is left: the last job to end does not set a branch back.
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
        repo_parts = layout.repo_dir(repo.dirname)
        path = self.layout.ref(repo.dirname, revision)
        try:
            # read later than ours (one in the future is a clock's error: not trusted)
            if resolved_at is not None and resolved_at < _mtime(path) <= time.time():
                return
            self.fs.atomic_write(
                (*repo_parts, "refs", *parts[:-1]), parts[-1], commit.encode(), purpose="ref"
            )
            if resolved_at is not None:
                os.utime(path, (resolved_at, resolved_at), follow_symlinks=False)
        except OSError as exc:
            raise disk_error(exc, f"write ref {path}") from exc

    def read_ref(self, repo: RepoRef, revision: str) -> str | None:
        """The commit ``revision`` points to, or ``None`` when no ref is cached."""
        path = self.layout.ref(repo.dirname, revision)
        data = self.fs.read_small(path)
        if data is None:
            return None
        commit = parse_ref(data)
        if commit is None:
            raise CacheError(f"{path} does not hold a commit hash")
        return commit

    def write_snapshot_record(self, record: SnapshotRecord) -> None:
        """Mark a snapshot complete: atomic, durable, and the last write of a download.

        The view's links are made durable first (``blobs/`` and every folder of the
        snapshot), so after a power loss no record or ref names links that are gone.
        """
        data = record.to_json()
        parts = (*layout.RECORDS, record.repo.dirname)
        name = layout.record_name(record.commit)
        try:
            self._sync_view(record.repo, record.commit)
            self.fs.atomic_write(parts, name, data, purpose="record")
            self.fs.unlink_at(parts, layout.pending_name(record.commit))  # the record says it
        except OSError as exc:
            raise disk_error(exc, f"write {self.root.joinpath(*parts, name)}") from exc

    def _sync_view(self, repo: RepoRef, commit: str) -> None:
        fd = self.fs.walk_existing((*layout.repo_dir(repo.dirname), "blobs"))
        if fd is not None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        top = self.snapshot_dir(repo, check_commit(commit))
        for folder, _dirs, _files in os.walk(top):
            fd = os.open(folder, DIR_FLAGS)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def read_snapshot_record(self, repo: RepoRef, commit: str) -> SnapshotRecord | None:
        path = self.layout.record(repo.dirname, commit)
        data = self.fs.read_small(path)
        if data is None:
            return None
        record = SnapshotRecord.from_json(data)
        if record.repo != repo or record.commit != commit:
            raise CacheError(f"{path} describes another snapshot")
        return record

    def find_complete(self, repo: RepoRef, revision: str) -> SnapshotRecord | None:
        """The record of a complete snapshot for ``revision``, or ``None``.

        Complete means: the record exists and parses, and every file's snapshot link points
        at its blob, which is a regular file of the recorded size and the store's very blob
        (a hard link of it, not a copy). Only ``stat`` calls, no hashing. A corrupt ref or
        record counts as absent, so the next download rewrites it.
        """
        if is_commit(revision):
            commit: str | None = revision
        else:
            ref = self.fs.read_small(self.layout.ref(repo.dirname, revision))
            commit = None if ref is None else parse_ref(ref)
        if commit is None:
            return None
        data = self.fs.read_small(self.layout.record(repo.dirname, commit))
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
                if os.readlink(link) != blob_target(parts, f.etag):
                    return None
                st = os.stat(link)
                blob = os.stat(self.blob_path(f.sha256))
            except OSError as exc:
                if exc.errno in _MISSING_ERRNOS:
                    return None
                raise disk_error(exc, f"stat {link}") from exc
            if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                return None
            if (st.st_dev, st.st_ino) != (blob.st_dev, blob.st_ino):
                return None  # a copy beside the store's verified blob (``cp -r`` of a cache)
        return record

    # -- locks --------------------------------------------------------------------------

    def lock(self, key: str, *, shared: bool = False) -> BlobLock:
        """A lock on ``key`` shared by every process using this cache (not yet acquired)."""
        path = self.layout.lock(key)
        try:
            os.close(self.fs.walk(layout.LOCKS))
        except OSError as exc:
            raise disk_error(exc, f"create {path.parent}") from exc
        return BlobLock(path, shared=shared)

    # -- lifecycle: state files, eviction, quarantine (snapshot_use, prune, verify) --------

    def write_state_file(self, *parts: str, data: bytes) -> None:
        """Atomically replace ``state/<parts...>`` (leases, the compacted access log)."""
        names = layout.check_state_parts(parts)
        try:
            self.fs.atomic_write((*layout.STATE, *names[:-1]), names[-1], data, purpose="state")
        except OSError as exc:
            # a lease, the journal, the access log: no download's bytes are in question
            raise disk_error(exc, f"write {self.layout.state(*names)}", then=_STATE_THEN) from exc

    def append_state_file(self, *parts: str, data: bytes) -> int:
        """Append ``data`` to ``state/<parts...>`` with one ``O_APPEND`` write; returns the new
        size. Not fsynced: an access record lost in a crash only makes a snapshot look older."""
        names = layout.check_state_parts(parts)
        path = self.layout.state(*names)
        try:
            with self.fs.dir((*layout.STATE, *names[:-1])) as dir_fd:
                flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(names[-1], flags, _FILE_MODE, dir_fd=dir_fd)
                try:
                    _write_all(fd, data)
                    return os.fstat(fd).st_size
                finally:
                    os.close(fd)
        except OSError as exc:
            raise disk_error(exc, f"append to {path}") from exc

    def touch_state_file(self, *parts: str) -> bool:
        """Set the mtime of ``state/<parts...>`` to now (a lease heartbeat); False if absent."""
        names = layout.check_state_parts(parts)
        path = self.layout.state(*names)
        try:
            fd = self.fs.walk_existing((*layout.STATE, *names[:-1]))
            if fd is None:
                return False
            try:
                os.utime(names[-1], dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise disk_error(exc, f"touch {path}") from exc
        return True

    def remove_state_file(self, *parts: str) -> bool:
        """Unlink ``state/<parts...>``; False when it was already gone."""
        names = layout.check_state_parts(parts)
        try:
            return self.fs.unlink_at((*layout.STATE, *names[:-1]), names[-1])
        except OSError as exc:
            raise disk_error(exc, f"remove {self.layout.state(*names)}") from exc

    def snapshot_records(self) -> Iterator[tuple[str, str, SnapshotRecord | None]]:
        """Every ``(repo dirname, commit, record)`` under ``state/snapshots``. The record is
        None when the file does not parse or describes another snapshot (it counts as absent)."""
        for dirname in self.fs.list_area(layout.RECORDS):
            if not layout.is_repo_dirname(dirname):
                continue
            base = self.layout.records(dirname)
            for name in _list_names(base):
                commit, _, ext = name.partition(".")
                if ext != "json" or not is_commit(commit):
                    continue
                data = self.fs.read_small(base / name)
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

    # -- low level ----------------------------------------------------------------------

    def _check_version(self) -> bool:
        """Whether ``VERSION`` exists; refuses a cache of another layout version."""
        path = self.layout.path("VERSION")
        data = self.fs.read_small(path)
        if data is None:
            return False
        text = data.decode("ascii", "replace").strip()
        if not text.isdigit():
            raise CacheError(f"{path} is corrupt: {text[:40]!r}")
        if int(text) != layout.LAYOUT_VERSION:
            raise CacheError(
                f"the cache at {self.root} has layout version {int(text)}; "
                f"this shardsync reads version {layout.LAYOUT_VERSION} only"
            )
        return True


def parse_ref(data: bytes) -> str | None:
    text = data.decode("ascii", "replace").strip()
    return text if is_commit(text) else None
