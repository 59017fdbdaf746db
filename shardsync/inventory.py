"""What the cache holds, read without changing anything: the one scanner of a cache.

``survey`` stats the store, the download slots and the repo folders (cheap: ``status``, the
daemon's summary, the prune trigger); ``scan`` adds records, refs, links, leases and use
(``ls`` and prune's input). Sizes are bytes on disk (``st_blocks``), and a blob is counted
once however many snapshots, revisions and repos link to it: the per-snapshot and per-repo
figures therefore add up to more than the total when blobs are shared.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shardsync import layout
from shardsync.cache import CacheStore
from shardsync.errors import CacheError, ConfigError, disk_error
from shardsync.layout import CacheLayout
from shardsync.names import is_commit
from shardsync.prune_plan import Leftover, matches
from shardsync.records import SnapshotRecord
from shardsync.slot import in_progress
from shardsync.snapshot_use import AccessLog, LeaseInfo, Leases

__all__ = [
    "Inventory",
    "RepoInfo",
    "SnapshotInfo",
    "StoreBlob",
    "Survey",
    "cache_summary",
    "inventory_to_json",
    "scan",
    "summary_to_json",
    "survey",
]


@dataclass(frozen=True, slots=True)
class StoreBlob:
    sha256: str
    size: int
    nbytes: int  # on disk
    nlink: int
    inode: tuple[int, int]
    changed_at: float  # ctime: publish, or the last link added or removed


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    dirname: str
    repo: str
    kind: str  # hub | url | local
    commit: str
    refs: tuple[str, ...]
    complete: bool  # a record, and every file linked to a blob of the recorded size
    recorded: bool  # a record: complete once (a quarantined blob's gap waits for a prefetch)
    files: int
    blobs: frozenset[str]  # store blobs (sha256) it refers to, by record or by link
    etags: frozenset[str]  # the repo's blobs/<etag> its links point to
    foreign: bool  # it holds files that are not shardsync blobs (huggingface_hub's own)
    nbytes: int
    last_used: float | None  # last recorded use, else when it was completed
    last_activity: float  # last use or change: what "stale" measures for incomplete ones
    leased: bool
    pinned: bool


@dataclass(frozen=True, slots=True)
class RepoInfo:
    dirname: str
    repo: str
    kind: str
    snapshots: tuple[SnapshotInfo, ...]
    links: Mapping[str, str]  # blobs/<etag> -> store sha256, for links to shardsync blobs
    nbytes: int
    leased: bool  # a lease covers the whole repo (a job that does not know its commit yet)
    pinned: bool

    @property
    def last_used(self) -> float | None:
        used = [s.last_used for s in self.snapshots if s.last_used is not None]
        return max(used) if used else None


@dataclass(frozen=True, slots=True)
class Survey:
    """What a stat-only walk of a cache finds."""

    root: Path
    blobs: tuple[StoreBlob, ...]
    partials: tuple[Leftover, ...]  # download slots with files on disk
    repo_dirs: Mapping[str, tuple[str, ...]]  # repo folder name -> its snapshot folder names
    disk_free: int | None
    disk_total: int | None
    counted: frozenset[tuple[int, int]]  # inodes counted so far (a file has several names)

    @property
    def blob_bytes(self) -> int:
        return sum(b.nbytes for b in self.blobs)

    @property
    def partial_bytes(self) -> int:
        return sum(p.nbytes for p in self.partials)


@dataclass(frozen=True, slots=True)
class Inventory(Survey):
    """The survey, and what records, refs, links, leases and the access log add to it."""

    scanned_at: float
    repos: tuple[RepoInfo, ...]
    junk: tuple[Leftover, ...]  # tmp/ and quarantine/ entries
    foreign_bytes: int
    leases: tuple[LeaseInfo, ...]  # live ones

    @property
    def junk_bytes(self) -> int:
        return sum(j.nbytes for j in self.junk)

    @property
    def total_bytes(self) -> int:
        return self.blob_bytes + self.partial_bytes + self.junk_bytes + self.foreign_bytes

    def find_repo(self, name: str) -> RepoInfo:
        """The repo called ``name`` (its id, URL, path or folder name); ConfigError if none."""
        for repo in self.repos:
            if name in (repo.repo, repo.dirname):
                return repo
        raise ConfigError(f"no repo {name!r} in the cache at {self.root}")


def survey(root: Path) -> Survey:
    """Stat the store, the download slots and the repo folders of the cache at ``root``
    (which may not exist: nothing is created)."""
    where = CacheLayout(Path(root))
    blobs = _store_blobs(where.store)
    # Every inode is counted once: a download's partial has a second, private name in tmp/
    # (left behind by a kill -9 or a full disk), and a blob may still have one too.
    counted: set[tuple[int, int]] = {b.inode for b in blobs}
    partials = tuple(_partial(key, paths, counted) for key, paths in in_progress(where).items())
    repos = {
        name: tuple(_names(where.repo(name) / "snapshots"))
        for area in (layout.HUB, layout.OTHER)
        for name in _names(where.path(*area))
        if layout.is_repo_dirname(name)
    }
    free = total = None
    with contextlib.suppress(OSError):
        vfs = os.statvfs(where.root)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
    return Survey(where.root, blobs, partials, repos, free, total, frozenset(counted))


def cache_summary(root: Path) -> dict[str, Any]:
    """Blobs, partial downloads, repositories and free space of a cache root (reads only):
    the daemon's ``/v1/cache`` and the in-process client's ``cache()``."""
    return summary_to_json(survey(root))


def summary_to_json(found: Survey) -> dict[str, Any]:
    """The daemon's ``/v1/cache`` and ``status``: blobs, partial downloads, repos, free space."""
    return {
        "root": str(found.root),
        "blobs": len(found.blobs),
        "bytes": sum(b.size for b in found.blobs),
        "partial_files": len(found.partials),
        "partial_bytes": found.partial_bytes,
        "repos": [
            {
                "dir": name,
                "repo": layout.name_of_dirname(name) if name.startswith("models--") else None,
                "snapshots": list(snapshots),
            }
            for name, snapshots in found.repo_dirs.items()
        ],
        "disk_free": found.disk_free,
        "disk_total": found.disk_total,
    }


def scan(
    cache: CacheStore,
    *,
    pin: Iterable[str] = (),
    now: float | None = None,
    leases: Leases | None = None,
) -> Inventory:
    """Read the whole cache: store, repos, records, access log, leases, leftovers."""
    now = time.time() if now is None else now
    pin = tuple(pin)
    found = survey(cache.root)
    by_inode = {b.inode: b for b in found.blobs}
    records: dict[tuple[str, str], SnapshotRecord | None] = {
        (dirname, commit): record for dirname, commit, record in cache.snapshot_records()
    }
    used = AccessLog(cache).last_used()
    live = (leases or Leases(cache)).live(now=now)
    foreign: dict[tuple[int, int], int] = {}
    counted = set(found.counted)
    repos = [
        _scan_repo(cache, dirname, records, used, live, pin, by_inode, foreign, now=now)
        for dirname in sorted(found.repo_dirs.keys() | {d for d, _ in records})
    ]
    where = cache.layout
    return Inventory(
        **{f.name: getattr(found, f.name) for f in fields(Survey)},
        scanned_at=now,
        repos=tuple(repos),
        junk=_junk(where.path(*layout.TMP), "tmp", counted)
        + _junk(where.path(*layout.QUARANTINE), "quarantine", counted),
        foreign_bytes=sum(foreign.values()),
        leases=live,
    )


def _scan_repo(
    cache: CacheStore,
    dirname: str,
    records: Mapping[tuple[str, str], SnapshotRecord | None],
    used: Mapping[tuple[str, str], float],
    live: tuple[LeaseInfo, ...],
    pin: tuple[str, ...],
    by_inode: Mapping[tuple[int, int], StoreBlob],
    foreign: dict[tuple[int, int], int],
    *,
    now: float,
) -> RepoInfo:
    repo_dir = cache.layout.repo(dirname)
    mine = [r for (d, _), r in records.items() if d == dirname and r is not None]
    ref = mine[0].repo if mine else None
    name = ref.name if ref else layout.name_of_dirname(dirname)
    kind = ref.kind if ref else layout.kind_of_dirname(dirname)
    pinned = matches(pin, name, dirname)

    links: dict[str, str] = {}  # etag -> sha256
    foreign_links: dict[str, tuple[tuple[int, int], int]] = {}
    for etag in _names(repo_dir / "blobs"):
        with contextlib.suppress(OSError):
            st = os.lstat(repo_dir / "blobs" / etag)
            if not stat.S_ISREG(st.st_mode):
                continue
            blob = by_inode.get((st.st_dev, st.st_ino))
            if blob is not None:
                links[etag] = blob.sha256
            else:
                foreign_links[etag] = ((st.st_dev, st.st_ino), st.st_blocks * 512)
    for inode, nbytes in foreign_links.values():
        foreign[inode] = nbytes

    refs = _refs(repo_dir / "refs")
    # a repo folder that is a symlink is someone's arrangement, not a folder shardsync made
    linked = os.path.islink(repo_dir)
    commits = set(_names(repo_dir / "snapshots")) | {c for d, c in records if d == dirname}
    snapshots = []
    sizes = {b.sha256: b.nbytes for b in by_inode.values()}
    for commit in sorted(commits):
        record = records.get((dirname, commit))
        snap_dir = repo_dir / "snapshots" / commit
        etags, files, is_foreign, changed = _walk_snapshot(snap_dir)
        shas = {links[e] for e in etags if e in links}
        if record is not None:
            shas.update(f.sha256 for f in record.files if f.sha256 in sizes)
        # a name that is no commit (a user's copy, another tool's file) is not ours: kept,
        # with whatever it links to
        foreign_here = is_foreign or any(e in foreign_links for e in etags) or not is_commit(commit)
        # shardsync writes a ref after the record, and marks a snapshot it makes before its
        # first link: one without a record is another tool's unless marked (huggingface_hub's,
        # reusing our blobs for a commit that changed a README, pinned or named by a ref)
        foreign_here = foreign_here or linked or (record is None and commit in refs)
        if record is None and not foreign_here:
            foreign_here = not cache.layout.pending(dirname, commit).exists()
        nbytes = sum(sizes[s] for s in shas) + sum(
            foreign_links[e][1] for e in etags if e in foreign_links
        )
        complete = False
        if record is not None:
            with contextlib.suppress(CacheError):
                complete = cache.find_complete(record.repo, commit) is not None
        last_used = used.get((dirname, commit))
        if record is not None:
            last_used = max(last_used or 0.0, record.completed_at)
        snapshots.append(
            SnapshotInfo(
                dirname=dirname,
                repo=name,
                kind=kind,
                commit=commit,
                refs=tuple(sorted(refs.get(commit, ()))),
                complete=complete,
                recorded=record is not None,
                files=len(record.files) if record is not None else files,
                blobs=frozenset(shas),
                etags=frozenset(etags),
                foreign=foreign_here,
                nbytes=nbytes,
                last_used=last_used,
                last_activity=max(last_used or 0.0, changed),
                leased=any(lease.covers(dirname, commit) for lease in live),
                pinned=pinned,
            )
        )
    unique = {s for snap in snapshots for s in snap.blobs}
    return RepoInfo(
        dirname=dirname,
        repo=name,
        kind=kind,
        snapshots=tuple(snapshots),
        links=links,
        nbytes=sum(sizes[s] for s in unique)
        + sum(n for e, (_, n) in foreign_links.items() if any(e in s.etags for s in snapshots)),
        leased=any(lease.dirname == dirname and lease.commit is None for lease in live),
        pinned=pinned,
    )


def _walk_snapshot(path: Path) -> tuple[set[str], int, bool, float]:
    """(etags its links point to, files, whether any is not a link to blobs/, newest mtime of
    its folders: when a file was last added)."""
    etags: set[str] = set()
    files = 0
    is_foreign = False
    changed = 0.0
    for top, dirs, names in os.walk(path):
        with contextlib.suppress(OSError):
            changed = max(changed, os.lstat(top).st_mtime)
        for name in names + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            files += 1
            full = os.path.join(top, name)
            try:
                target = os.readlink(full)
            except OSError:
                is_foreign = True  # a regular file: huggingface_hub without symlinks
                continue
            head, _, etag = target.rpartition("/")
            if head.endswith("blobs"):
                etags.add(etag)
            else:
                is_foreign = True
    return etags, files, is_foreign, changed


def _refs(path: Path) -> dict[str, list[str]]:
    """commit -> ref names (``main``, ``refs/pr/1``)."""
    found: dict[str, list[str]] = defaultdict(list)
    for top, _dirs, names in os.walk(path):
        for name in names:
            full = Path(top) / name
            with contextlib.suppress(OSError, UnicodeDecodeError):
                if full.is_symlink():
                    continue
                commit = full.read_text(encoding="ascii").strip()
                found[commit].append(full.relative_to(path).as_posix())
    return found


def _store_blobs(store: Path) -> tuple[StoreBlob, ...]:
    blobs = []
    for shard in _names(store):
        for name in _names(store / shard):
            with contextlib.suppress(OSError):
                st = os.lstat(store / shard / name)
                if stat.S_ISREG(st.st_mode) and len(name) == 64 and name.startswith(shard):
                    blobs.append(
                        StoreBlob(
                            sha256=name,
                            size=st.st_size,
                            nbytes=st.st_blocks * 512,
                            nlink=st.st_nlink,
                            inode=(st.st_dev, st.st_ino),
                            changed_at=st.st_ctime,
                        )
                    )
    return tuple(blobs)


def _once(st: os.stat_result, counted: set[tuple[int, int]]) -> int:
    """Bytes on disk of a file, or 0 when another name of the same inode was counted."""
    inode = (st.st_dev, st.st_ino)
    if inode in counted:
        return 0
    if st.st_nlink > 1:
        counted.add(inode)
    return st.st_blocks * 512


def _partial(key: str, paths: Iterable[Path], counted: set[tuple[int, int]]) -> Leftover:
    """One download slot as a leftover: its partial and resume record together."""
    nbytes, mtime = 0, 0.0
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            nbytes += _once(st, counted)
            mtime = max(mtime, st.st_mtime)
    return Leftover("partial", key, nbytes, mtime)


def _junk(directory: Path, kind: str, counted: set[tuple[int, int]]) -> tuple[Leftover, ...]:
    found = []
    for name in _names(directory):
        if kind == "tmp" and layout.is_live_temp(name):
            continue  # a running download's own name for its file: work, not junk
        if not layout.is_junk_name(kind, name):
            continue  # a name shardsync never writes there: not ours to remove
        path = directory / name
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            nbytes, mtime = _once(st, counted), st.st_mtime
            if stat.S_ISDIR(st.st_mode):
                for top, _dirs, names in os.walk(path):
                    for n in names:
                        with contextlib.suppress(OSError):
                            inner = os.lstat(os.path.join(top, n))
                            nbytes += _once(inner, counted)
                            mtime = max(mtime, inner.st_mtime)
            found.append(Leftover("tmp" if kind == "tmp" else "quarantine", name, nbytes, mtime))
    return tuple(found)


def _names(path: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(path) if not n.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise disk_error(exc, f"list {path}") from exc


def inventory_to_json(inv: Inventory) -> dict[str, Any]:
    """``shardsync ls --json``; the shape is documented in docs/cache.md (fields only added)."""
    return {
        "root": str(inv.root),
        "bytes_on_disk": inv.total_bytes,
        "blob_bytes": inv.blob_bytes,
        "partial_bytes": inv.partial_bytes,
        "junk_bytes": inv.junk_bytes,
        "foreign_bytes": inv.foreign_bytes,
        "disk_free": inv.disk_free,
        "disk_total": inv.disk_total,
        "repos": [
            {
                "repo": r.repo,
                "kind": r.kind,
                "dir": r.dirname,
                "bytes_on_disk": r.nbytes,
                "last_used": r.last_used,
                "pinned": r.pinned,
                "leased": r.leased or any(s.leased for s in r.snapshots),
                "snapshots": [
                    {
                        "commit": s.commit,
                        "refs": list(s.refs),
                        "complete": s.complete,
                        "files": s.files,
                        "bytes_on_disk": s.nbytes,
                        "last_used": s.last_used,
                        "leased": s.leased,
                        "foreign": s.foreign,
                    }
                    for s in r.snapshots
                ],
            }
            for r in inv.repos
        ],
    }
