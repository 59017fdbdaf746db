"""``shardsync verify``: re-hash the blobs of complete snapshots, quarantine corrupt ones.

The fast check recomputes xxh3-128 (GB/s) and compares it with the value recorded when the
blob was published; ``full`` also recomputes sha256, which for Hub LFS files is the Hub's
own oid (and the git blob id of small Hub files). Every blob is hashed once, however many
snapshots share it; blobs are read through their store name, the inode every repo link is a
hard link of.

A corrupt blob is quarantined (``CacheRemoval.quarantine_blob``): out of the store and out of
every repo view, snapshot symlinks included, so Hugging Face readers find no file instead of
bad bytes. The snapshots that held it are incomplete from then on (``find_complete`` checks
every link), while their records stay: the next ``shardsync prefetch`` downloads exactly the
missing blob and reuses the rest by those records' hints. A store blob that is missing has its
snapshot links removed the same way; a snapshot whose link is missing is reported (it is
already incomplete) on every run until a prefetch repairs it. Quarantine runs under the
prune gate, so it never interleaves with a prune.
"""

from __future__ import annotations

import errno
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from shardsync.cache import CacheStore
from shardsync.digest import Digest
from shardsync.errors import CacheError, ConfigError, disk_error
from shardsync.layout import blob_target
from shardsync.prune_plan import matches
from shardsync.records import FileRecord, SnapshotRecord
from shardsync.removal import CacheRemoval
from shardsync.snapshot_use import prune_gate, wait_lock

__all__ = ["EXIT_PROBLEMS", "Problem", "VerifyReport", "verify_cache"]

EXIT_PROBLEMS = 13
"""``shardsync verify`` exit status when anything was wrong (0: all blobs intact)."""

Kind = Literal["corrupt", "size", "missing"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One file of one snapshot that was not right, and what was done about it."""

    repo: str
    dirname: str
    commit: str
    path: str
    sha256: str
    kind: Kind
    detail: str
    quarantined: Path | None  # where the corrupt blob went


@dataclass(frozen=True, slots=True)
class VerifyReport:
    full: bool
    snapshots: int
    blobs: int
    bytes_hashed: int
    problems: tuple[Problem, ...]
    incomplete: tuple[tuple[str, str], ...]  # (repo, commit) now incomplete, to re-prefetch

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """``shardsync verify --json``; documented in docs/cache.md (fields are only added)."""
        return {
            "ok": self.ok,
            "full": self.full,
            "snapshots": self.snapshots,
            "blobs": self.blobs,
            "bytes_hashed": self.bytes_hashed,
            "problems": [
                {
                    "repo": p.repo,
                    "dir": p.dirname,
                    "commit": p.commit,
                    "path": p.path,
                    "sha256": p.sha256,
                    "problem": p.kind,
                    "detail": p.detail,
                    "quarantined": None if p.quarantined is None else str(p.quarantined),
                }
                for p in self.problems
            ],
            "incomplete": [{"repo": r, "commit": c} for r, c in self.incomplete],
        }


@dataclass(frozen=True, slots=True)
class _Expected:
    size: int
    xxh3: frozenset[str]
    git_ids: frozenset[str]  # etags of files verified as git blobs


@dataclass(frozen=True, slots=True)
class _Outcome:
    sha256: str
    kind: Kind | None  # None: intact
    detail: str
    inode: tuple[int, int] | None
    hashed: int


def verify_cache(
    cache: CacheStore,
    repo: str | None = None,
    *,
    full: bool = False,
    workers: int = 4,
    timeout: float | None = None,
) -> VerifyReport:
    """Check every complete snapshot (of ``repo``: a name, folder name or pattern, when
    given); quarantine what is corrupt. Blocking: the daemon would run it in a thread."""
    snapshots = [
        (dirname, commit, record)
        for dirname, commit, record in cache.snapshot_records()
        if record is not None and (repo is None or matches([repo], record.repo.name, dirname))
    ]
    if repo is not None and not snapshots:
        raise ConfigError(f"no complete snapshot of {repo!r} in the cache at {cache.root}")

    problems: list[Problem] = []
    broken: set[tuple[str, str]] = set()
    expected: dict[str, _Expected] = {}
    for dirname, commit, record in snapshots:
        for f in record.files:
            detail = _link_problem(cache, dirname, commit, f)
            if detail is not None:
                problems.append(_problem(record, dirname, f, "missing", detail, None))
                broken.add((dirname, commit))
            expected[f.sha256] = _merge(expected.get(f.sha256), f)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        outcomes = list(
            pool.map(
                lambda item: _check_blob(cache, item[0], item[1], full=full),
                sorted(expected.items()),
            )
        )

    bad = {o.sha256: o for o in outcomes if o.kind is not None}
    moved: dict[str, Path | None] = {}
    if bad or broken:
        gate = prune_gate(cache, shared=False)
        wait_lock(gate, timeout)
        try:
            # a prune may have evicted snapshots while we hashed: those are not problems
            current = {(d, c) for d, c, r in cache.snapshot_records() if r is not None}
            snapshots = [s for s in snapshots if (s[0], s[1]) in current]
            problems = [p for p in problems if (p.dirname, p.commit) in current]
            broken &= current
            for sha, outcome in list(bad.items()):
                if outcome.kind == "missing" and cache.has_blob(sha):
                    del bad[sha]  # published again meanwhile
            for sha, outcome in bad.items():
                if outcome.kind != "missing":
                    moved[sha] = CacheRemoval(cache).quarantine_blob(sha, outcome.inode).path
                    continue
                moved[sha] = None
                for dirname, commit, record in snapshots:  # links to a copy we cannot check
                    for f in record.files:
                        if f.sha256 == sha:
                            CacheRemoval(cache).unlink_snapshot_file(dirname, commit, f.path)
        finally:
            gate.release()

    for dirname, commit, record in snapshots:
        for f in record.files:
            found = bad.get(f.sha256)
            if found is not None and found.kind is not None:
                problems.append(
                    _problem(record, dirname, f, found.kind, found.detail, moved[f.sha256])
                )
                broken.add((dirname, commit))
    # one problem per file: a missing blob also breaks its link, and what the blob's check
    # found (and did with it) says more than the link does; it keeps the link's place
    one = {(p.dirname, p.commit, p.path): p for p in problems}
    names = {(d, c): r.repo.name for d, c, r in snapshots}
    return VerifyReport(
        full=full,
        snapshots=len(snapshots),
        blobs=len(expected),
        bytes_hashed=sum(o.hashed for o in outcomes),
        problems=tuple(one.values()),
        incomplete=tuple(sorted((names[k], k[1]) for k in broken)),
    )


def _merge(seen: _Expected | None, f: FileRecord) -> _Expected:
    git = frozenset({f.etag}) if f.verified == "git-sha1" else frozenset()
    if seen is None:
        return _Expected(f.size, frozenset({f.xxh3_128}), git)
    # records that disagree about one sha256 can never both be satisfied: size -1 fails
    size = seen.size if seen.size == f.size else -1
    return _Expected(size, seen.xxh3 | {f.xxh3_128}, seen.git_ids | git)


def _link_problem(cache: CacheStore, dirname: str, commit: str, f: FileRecord) -> str | None:
    """Why the snapshot's link for ``f`` is not the one the record promises, if it is not."""
    parts = f.path.split("/")
    link = cache.layout.snapshot(dirname, commit).joinpath(*parts)
    target = blob_target(parts, f.etag)
    try:
        found = os.readlink(link)
    except FileNotFoundError:
        return f"{link} is missing"
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # unreadable (EACCES, EIO): not a problem of the link's
            raise disk_error(exc, f"read {link}") from exc
        return f"{link} is not a symlink"
    if found != target:
        return f"{link} points to {found!r}, not {target!r}"
    try:
        seen = os.stat(link)
        verified = os.stat(cache.blob_path(f.sha256))
    except FileNotFoundError as exc:
        # a missing store blob is its own check's to report
        return f"{link} points to a missing blob" if exc.filename == str(link) else None
    except OSError as exc:
        raise disk_error(exc, f"stat {link}") from exc
    if (seen.st_dev, seen.st_ino) != (verified.st_dev, verified.st_ino):
        # a copy of the cache without its hard links: readers read bytes no hash checks
        return f"{link} reads a copy of its blob, not the store's verified file"
    return None


def _check_blob(cache: CacheStore, sha256: str, expected: _Expected, *, full: bool) -> _Outcome:
    path = cache.blob_path(sha256)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Outcome(sha256, "missing", f"{path} is not in the store", None, 0)
    except OSError as exc:
        raise CacheError(f"cannot read {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        inode = (st.st_dev, st.st_ino)
        if expected.size != st.st_size:
            want = "disagreeing sizes" if expected.size < 0 else f"{expected.size} bytes"
            return _Outcome(sha256, "size", f"{st.st_size} bytes, records say {want}", inode, 0)
        git_size = st.st_size if full and expected.git_ids else None
        digest = Digest(sha256=full, git_size=git_size)
        try:
            digest.read(f)
        except OSError as exc:
            why = f"read error: {exc.strerror}"
            return _Outcome(sha256, "corrupt", why, inode, digest.nbytes)
    hashed = digest.nbytes
    if digest.xxh3_128 not in expected.xxh3 or len(expected.xxh3) > 1:
        return _Outcome(sha256, "corrupt", "xxh3-128 differs from the record", inode, hashed)
    if full and digest.sha256 != sha256:
        return _Outcome(sha256, "corrupt", "sha256 differs from the blob's name", inode, hashed)
    git = digest.git_sha1
    if git is not None and not expected.git_ids <= {git}:
        return _Outcome(sha256, "corrupt", "git blob id differs from the etag", inode, hashed)
    return _Outcome(sha256, None, "", inode, hashed)


def _problem(
    record: SnapshotRecord,
    dirname: str,
    f: FileRecord,
    kind: Kind,
    detail: str,
    quarantined: Path | None,
) -> Problem:
    return Problem(
        repo=record.repo.name,
        dirname=dirname,
        commit=record.commit,
        path=f.path,
        sha256=f.sha256,
        kind=kind,
        detail=detail,
        quarantined=quarantined,
    )
