"""Taking things out of the cache in the order readers can bear (prune, verify, sweeps).

Only ``unlink`` and ``rename``, never a truncate or an overwrite: a process that has a blob
open or mapped keeps reading its bytes. A snapshot leaves refs first (Hugging Face readers
stop resolving to it), then its record (shardsync stops trusting it), then its folder in one
rename; blobs go last, and only once nothing links to them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardsync import layout
from shardsync.cache import DIR_FLAGS, CacheRoot, CacheStore, parse_ref
from shardsync.errors import CacheError, disk_error
from shardsync.layout import check_dirname, file_parts, temp_name
from shardsync.locks import BlobLock
from shardsync.names import check_etag, check_sha256

__all__ = ["CacheRemoval", "Quarantined", "remove_idle_locks", "sweep_orphans"]


@dataclass(frozen=True, slots=True)
class Quarantined:
    """What ``CacheRemoval.quarantine_blob`` did."""

    path: Path | None  # where the store blob went; None when it was no longer in the store
    links: tuple[Path, ...]  # snapshot symlinks and repo blob links removed


class CacheRemoval:
    """Removals from one cache: snapshots, repo links, blobs, leftovers, corrupt blobs."""

    __slots__ = ("fs",)

    def __init__(self, cache: CacheStore) -> None:
        self.fs: CacheRoot = cache.fs

    def evict_snapshot(self, dirname: str, commit: str) -> None:
        """Take one snapshot out of the cache in the order readers can bear.

        First every ref naming the commit (Hugging Face readers stop resolving to it), then its
        completeness record (shardsync stops trusting it), then its folder, which leaves the
        view in one ``rename`` into ``tmp/`` and is emptied there. Blobs are not touched here:
        the caller unlinks ``blobs/<etag>`` and store blobs afterwards, once nothing it keeps
        refers to them.
        """
        repo = layout.repo_dir(dirname)
        path = self.fs.layout.snapshot(dirname, commit)
        try:
            self._remove_refs_to((*repo, "refs"), commit)
            # marked shardsync's first: a prune killed between the record and the folder
            # leaves an abandoned snapshot of ours, which the next prune removes, not one
            # that looks like another tool's and is kept for ever
            records = (*layout.RECORDS, dirname)
            self.fs.atomic_write(records, layout.pending_name(commit), b"", purpose="record")
            self.fs.unlink_at(records, layout.record_name(commit))
            self.fs.discard((*repo, "snapshots"), commit)
            self.fs.unlink_at(records, layout.pending_name(commit))
        except OSError as exc:
            raise disk_error(exc, f"evict {path}") from exc

    def remove_repo_blob(self, dirname: str, etag: str) -> bool:
        """Unlink ``blobs/<etag>`` of a repo (a hard link: the store keeps its own name)."""
        repo = layout.repo_dir(dirname)
        check_etag(etag)
        try:
            return self.fs.unlink_at((*repo, "blobs"), etag)
        except OSError as exc:
            path = self.fs.layout.repo(dirname) / "blobs" / etag
            raise disk_error(exc, f"remove {path}") from exc

    def remove_repo_if_empty(self, dirname: str) -> bool:
        """Remove a repo folder that holds no snapshot, blob or ref file any more.

        It leaves in one ``rename`` (``scan_cache_dir`` flags a repo without ``snapshots/``,
        so it must never be seen half removed); anything else inside (a Hugging Face download
        in progress, ``.no_exist``) keeps it.
        """
        area = check_dirname(dirname)
        path = self.fs.layout.repo(dirname)
        try:
            parent = self.fs.walk_existing((area,))
            if parent is None:
                return False
            try:
                if not self._repo_is_empty(parent, dirname):
                    return False
                with self.fs.dir(layout.TMP) as tmp_fd:
                    tmp = temp_name("evict")
                    os.rename(dirname, tmp, src_dir_fd=parent, dst_dir_fd=tmp_fd)
                    os.fsync(parent)
                    shutil.rmtree(tmp, dir_fd=tmp_fd)
            finally:
                os.close(parent)
            state = self.fs.walk_existing(layout.RECORDS)
            if state is not None:
                try:
                    with contextlib.suppress(OSError):
                        os.rmdir(dirname, dir_fd=state)  # only when no record is left
                finally:
                    os.close(state)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise disk_error(exc, f"remove {path}") from exc
        return True

    def remove_blob(self, sha256: str) -> int:
        """Unlink a store blob that no repo links to any more (``st_nlink == 1``).

        Returns the bytes it occupied, 0 when it is absent or still linked. Only unlink, never
        truncate: a process that has the blob open or mapped keeps reading its bytes.
        """
        path = self.fs.layout.blob(sha256)
        try:
            fd = self.fs.walk_existing(layout.blob_dir(sha256))
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
            raise disk_error(exc, f"remove {path}") from exc
        return st.st_blocks * 512

    def remove_junk(self, area: Literal["tmp", "quarantine"], name: str) -> None:
        """Remove an entry of ``tmp/`` (left by a crash) or ``quarantine/`` (a corrupt blob)."""
        if not layout.is_junk_name(area, name):
            raise CacheError(f"refusing to remove {area}/{name!r}")
        try:
            fd = self.fs.walk_existing((area,))
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
            raise disk_error(exc, f"remove {self.fs.layout.path(area, name)}") from exc

    def unlink_snapshot_file(self, dirname: str, commit: str, relpath: str) -> bool:
        """Remove one file's symlink from a snapshot, which makes the snapshot incomplete (the
        next download links it again); False when it was already gone."""
        repo = layout.repo_dir(dirname)
        parts = file_parts(relpath)
        path = self.fs.layout.snapshot(dirname, commit).joinpath(*parts)
        try:
            return self.fs.unlink_at((*repo, "snapshots", commit, *parts[:-1]), parts[-1])
        except OSError as exc:
            raise disk_error(exc, f"remove {path}") from exc

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
            store = self.fs.walk_existing(layout.blob_dir(sha256))
            if store is not None:
                try:
                    st = os.stat(sha256, dir_fd=store, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and inode in (None, (st.st_dev, st.st_ino)):
                        target = (st.st_dev, st.st_ino)
                        with self.fs.dir(layout.QUARANTINE) as q_fd:
                            name = layout.quarantine_name(sha256)
                            os.rename(sha256, name, src_dir_fd=store, dst_dir_fd=q_fd)
                            os.fsync(q_fd)
                            os.fsync(store)
                            moved = self.fs.layout.path(*layout.QUARANTINE, name)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(store)
            links: list[Path] = []
            if target is not None:
                for area, dirname in self._repo_dirs():
                    links.extend(self._unlink_inode_links(area, dirname, target))
        except OSError as exc:
            raise disk_error(exc, f"quarantine {self.fs.layout.blob(sha256)}") from exc
        return Quarantined(moved, tuple(links))

    def _unlink_inode_links(self, area: str, dirname: str, inode: tuple[int, int]) -> list[Path]:
        """Snapshot symlinks to, then the repo blob links of, one inode inside one repo."""
        repo = self.fs.layout.path(area, dirname)
        blobs = self.fs.walk_existing((area, dirname, "blobs"))
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
            snaps = self.fs.walk_existing((area, dirname, "snapshots"))
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
                if self.fs.unlink_at((area, dirname, "blobs"), etag):
                    removed.append(repo / "blobs" / etag)
            return removed
        finally:
            os.close(blobs)

    def _repo_dirs(self) -> Iterator[tuple[str, str]]:
        for area in ("hub", "other"):
            for name in self.fs.list_area((area,)):
                if layout.is_repo_dirname(name):
                    yield area, name

    def _repo_is_empty(self, parent: int, dirname: str) -> bool:
        repo = os.open(dirname, DIR_FLAGS, dir_fd=parent)
        try:
            names = set(os.listdir(repo))
            if not names <= {"blobs", "refs", "snapshots"}:
                return False
            for sub in sorted(names):
                fd = os.open(sub, DIR_FLAGS, dir_fd=repo)
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
        refs = self.fs.walk_existing(parts)
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
                    if parse_ref(data) == commit:
                        os.unlink(name, dir_fd=top_fd)
                        removed = True
                        os.fsync(top_fd)  # no ref may outlive the snapshot it names
            if removed:
                os.fsync(refs)
        finally:
            os.close(refs)


def sweep_orphans(cache: CacheStore) -> int:
    """Remove ``tmp/`` entries left by crashed processes of this host; how many went.

    Safe without a lock: the writer is gone. One is often a slot's private name, a second
    name of its partial, which would otherwise look like a live download and never resume.
    Entries of other hosts sharing the cache are left to prune's stale age, as a pid means
    nothing across hosts.
    """
    orphans = [name for name in cache.fs.list_area(layout.TMP) if layout.temp_owner(name) == "gone"]
    removal = CacheRemoval(cache)
    for name in orphans:
        removal.remove_junk("tmp", name)
    return len(orphans)


def remove_idle_locks(cache: CacheStore) -> int:
    """Unlink the lock files of downloads nobody holds (one per blob ever fetched would pile
    up otherwise); how many went. Each is removed while held (see ``BlobLock``)."""
    removed = 0
    for name in cache.fs.list_area(layout.LOCKS):
        if not layout.is_download_lock(name):
            continue  # the prune gate and the access log's lock stay
        lock = BlobLock(cache.layout.path(*layout.LOCKS, name))
        if not lock.try_acquire():
            continue
        try:
            os.unlink(lock.path)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise disk_error(exc, f"remove {lock.path}") from exc
        finally:
            lock.release()
    return removed
