"""Carry out a prune: scan, plan (``prune_plan.plan_prune``), delete in the order readers can bear.

Safe while downloads and loads run, and against itself:

* the decision and the deletions happen under the prune gate held exclusively
  (``snapshot_use.prune_gate``), so every lease taken before is seen and none is taken meanwhile;
  a second prune waits for the first (``wait=False``: it skips and says so);
* per snapshot: refs, then the completeness record, then the snapshot folder (one rename);
  then repo ``blobs/<etag>`` links nothing kept points to; store blobs last, and only those
  no link is left to (``st_nlink == 1``) and whose download lock is free;
* only ``unlink``/``rename``, never a truncate or an overwrite: a reader that has a blob open
  or mapped keeps reading the same bytes until it closes it (the space returns then).
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from shardsync.cache import CacheStore
from shardsync.config import PruneConfig
from shardsync.errors import DiskFullError
from shardsync.inventory import Inventory, scan, survey
from shardsync.manifest import ManifestEntry
from shardsync.prune_plan import (
    Blob,
    CacheView,
    Eviction,
    Limit,
    Limits,
    Protection,
    PrunePlan,
    Unit,
    matches,
    plan_prune,
)
from shardsync.removal import CacheRemoval, remove_idle_locks
from shardsync.slot import forget_gone_blobs, remove_abandoned
from shardsync.snapshot_use import AccessLog, Clock, Leases, prune_gate, wait_lock
from shardsync.store import AsyncStore

__all__ = [
    "CacheRoom",
    "Protected",
    "PruneReport",
    "ensure_free",
    "limits_from_config",
    "needs_prune",
    "prune_cache",
]

log = logging.getLogger("shardsync.prune")


@dataclass(frozen=True, slots=True)
class Protected:
    repo: str
    commit: str
    reason: Protection


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    skipped: bool  # another prune held the gate and wait=False
    limits: Limits
    size_before: int
    size_after: int
    free_before: int | None
    free_after: int | None
    evicted: tuple[Eviction, ...]
    partials: int
    partial_bytes: int
    orphans: int
    orphan_bytes: int
    junk: int
    junk_bytes: int
    leases_reaped: int
    protected: tuple[Protected, ...]
    unmet: tuple[Limit, ...]

    @property
    def freed_bytes(self) -> int:
        return self.size_before - self.size_after

    @property
    def satisfied(self) -> bool:
        return not self.unmet and not self.skipped

    def by_repo(self) -> dict[str, tuple[int, int]]:
        """repo -> (snapshots evicted, bytes freed)."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for e in self.evicted:
            out[e.repo][0] += 1
            out[e.repo][1] += e.freed_bytes
        return {repo: (n, b) for repo, (n, b) in sorted(out.items())}

    def to_json(self) -> dict[str, Any]:
        """``shardsync prune --json``; documented in docs/cache.md (fields are only added)."""
        return {
            "dry_run": self.dry_run,
            "skipped": self.skipped,
            "satisfied": self.satisfied,
            "unmet": list(self.unmet),
            "limits": {
                "max_size": self.limits.max_size,
                "min_free": self.limits.min_free,
                "max_age_s": self.limits.max_age,
                "stale_age_s": self.limits.stale_age,
            },
            "before": {"bytes_on_disk": self.size_before, "disk_free": self.free_before},
            "after": {"bytes_on_disk": self.size_after, "disk_free": self.free_after},
            "freed_bytes": self.freed_bytes,
            "evicted": [
                {
                    "repo": e.repo,
                    "dir": e.dirname,
                    "commit": e.commit,
                    "reason": e.reason,
                    "freed_bytes": e.freed_bytes,
                }
                for e in self.evicted
            ],
            "repos": [
                {"repo": repo, "snapshots": n, "freed_bytes": b}
                for repo, (n, b) in self.by_repo().items()
            ],
            "partials": {"files": self.partials, "freed_bytes": self.partial_bytes},
            "orphan_blobs": {"files": self.orphans, "freed_bytes": self.orphan_bytes},
            "junk": {"files": self.junk, "freed_bytes": self.junk_bytes},
            "leases_reaped": self.leases_reaped,
            "protected": [
                {"repo": p.repo, "commit": p.commit, "reason": p.reason} for p in self.protected
            ],
        }


class CacheRoom:
    """Disk space for a scheduler's jobs (its ``engine_api.Room``): before a download, a
    prune past the high-water mark and room for what the job will add, or a clear
    ``DiskFullError`` instead of a disk filled halfway; after it, the high-water prune."""

    __slots__ = ("config", "store")

    def __init__(self, store: AsyncStore, config: PruneConfig) -> None:
        self.store, self.config = store, config

    async def tidy(self, keep: str) -> None:
        cache, config = self.store.sync, self.config
        if not await asyncio.to_thread(needs_prune, cache, config):
            return
        kept = _by_name(keep)
        report = await asyncio.to_thread(
            prune_cache, cache, limits_from_config(config), pin=config.pin, keep=kept, wait=False
        )
        if report.freed_bytes:
            log.info("auto-prune freed %d bytes (high-water mark)", report.freed_bytes)

    async def make(
        self, entries: Iterable[ManifestEntry], keep: str, on_short: Callable[[int, int], None]
    ) -> None:
        cache, config = self.store.sync, self.config
        await self.tidy(keep)
        missing = await self.store.missing_bytes(entries)
        free = shutil.disk_usage(cache.root).free
        if missing and free < missing + (config.min_free or 0):
            on_short(missing, free)
            await asyncio.to_thread(
                ensure_free,
                cache,
                missing,
                limits_from_config(config),
                pin=config.pin,
                keep=_by_name(keep),
            )


def _by_name(repo: str) -> tuple[str, ...]:
    """The job's repo, kept as a name: ``run[1]`` read as a pattern does not match itself."""
    return (glob.escape(repo),)


def limits_from_config(
    config: PruneConfig,
    *,
    max_size: int | None = None,
    min_free: int | None = None,
    max_age: float | None = None,
) -> Limits:
    """The ``[prune]`` limits, each overridden by an argument that is not None."""
    return Limits(
        max_size=config.max_size if max_size is None else max_size,
        min_free=config.min_free if min_free is None else min_free,
        max_age=config.max_age if max_age is None else max_age,
        stale_age=config.stale_partial_age,
    )


def prune_cache(
    cache: CacheStore,
    limits: Limits,
    *,
    pin: Iterable[str] = (),
    keep: Iterable[str] = (),
    dry_run: bool = False,
    wait: bool = True,
    timeout: float | None = None,
    clock: Clock = time.time,
) -> PruneReport:
    """Prune ``cache`` to ``limits``; blocking (the daemon runs it in a worker thread).

    ``pin`` and ``keep`` are repo names or ``fnmatch`` patterns never touched. A dry run
    takes no lock and changes nothing. ``wait=False`` returns a report with ``skipped`` set
    when another prune holds the gate; ``timeout`` bounds the wait (then ``CacheError``).
    """
    pin, keep = tuple(pin), tuple(keep)
    if dry_run:
        return _prune_locked(cache, limits, pin, keep, dry_run=True, clock=clock)
    gate = prune_gate(cache, shared=False)
    if wait:
        wait_lock(gate, timeout)
    elif not gate.try_acquire():
        return _skipped(limits)
    try:
        return _prune_locked(cache, limits, pin, keep, dry_run=False, clock=clock)
    finally:
        gate.release()


def ensure_free(
    cache: CacheStore,
    nbytes: int,
    limits: Limits | None = None,
    *,
    pin: Iterable[str] = (),
    keep: Iterable[str] = (),
    timeout: float | None = None,
    clock: Clock = time.time,
) -> PruneReport:
    """Make room for a download of ``nbytes`` before it starts.

    Prunes so that ``nbytes`` plus ``limits.min_free`` are free (and the cache stays within
    ``max_size`` with the download in it). Raises ``DiskFullError`` when the filesystem still
    has less than ``nbytes`` free afterwards: the rest is pinned, leased or still open.
    """
    if nbytes < 0:
        raise ValueError("nbytes must not be negative")
    limits = limits or Limits()
    reserve = limits.min_free or 0
    target = replace(
        limits,
        min_free=nbytes + reserve,
        max_size=None if limits.max_size is None else max(limits.max_size - nbytes, 0),
    )
    report = prune_cache(cache, target, pin=pin, keep=keep, timeout=timeout, clock=clock)
    free = _disk_free(cache)
    if free is not None and free < nbytes:
        raise DiskFullError(
            f"not enough disk space for a download of {nbytes} bytes into {cache.root}: "
            f"{free} bytes free after pruning freed {report.freed_bytes}; what is left is "
            "pinned, leased, recently used partials, or held open by a reader"
        )
    return report


def needs_prune(cache: CacheStore, config: PruneConfig) -> bool:
    """Whether the cache passed its high-water mark (``high_water``, else ``max_size``) or
    the filesystem has less than ``min_free``: when the daemon should prune on its own.
    Cheap: stats the store and the partial files, reads nothing."""
    high = config.high_water if config.high_water is not None else config.max_size
    if high is not None and _quick_size(cache) > high:
        return True
    free = _disk_free(cache)
    return config.min_free is not None and free is not None and free < config.min_free


# --------------------------------------------------------------------------- internals


def _skipped(limits: Limits) -> PruneReport:
    return PruneReport(
        dry_run=False,
        skipped=True,
        limits=limits,
        size_before=0,
        size_after=0,
        free_before=None,
        free_after=None,
        evicted=(),
        partials=0,
        partial_bytes=0,
        orphans=0,
        orphan_bytes=0,
        junk=0,
        junk_bytes=0,
        leases_reaped=0,
        protected=(),
        unmet=(),
    )


def _prune_locked(
    cache: CacheStore,
    limits: Limits,
    pin: tuple[str, ...],
    keep: tuple[str, ...],
    *,
    dry_run: bool,
    clock: Clock,
) -> PruneReport:
    now = clock()
    leases = Leases(cache, clock=clock)
    reaped = 0 if dry_run else leases.reap(now=now)
    inv = scan(cache, pin=pin, now=now, leases=leases)
    view, protected, repo_protected = _view(inv, keep, now)
    plan = plan_prune(view, limits)
    if dry_run:
        return _report(plan, limits, protected, reaped, dry_run=True, skipped_bytes=0)
    skipped = _execute(cache, inv, plan, repo_protected, now=now, stale_age=limits.stale_age)
    evicted = {(e.dirname, e.commit) for e in plan.evictions}
    try:
        AccessLog(cache, clock=clock).compact(
            keep=[
                (s.dirname, s.commit)
                for r in inv.repos
                for s in r.snapshots
                if (s.dirname, s.commit) not in evicted
            ]
        )
    except DiskFullError as exc:  # the log only grows until a prune finds room to rewrite it
        log.warning("the access log is not compacted this time: %s", exc)
    report = _report(plan, limits, protected, reaped, dry_run=False, skipped_bytes=skipped)
    free = _disk_free(cache)  # the truth now: a blob still open elsewhere frees nothing yet
    unmet: list[Limit] = []
    if limits.max_size is not None and report.size_after > limits.max_size:
        unmet.append("max_size")
    if limits.min_free is not None and free is not None and free < limits.min_free:
        unmet.append("min_free")
    return replace(report, free_after=free, unmet=tuple(unmet))


def _view(
    inv: Inventory, keep: tuple[str, ...], now: float
) -> tuple[CacheView, tuple[Protected, ...], frozenset[str]]:
    """The planner's picture; which snapshots are protected, and why; and the repos protected
    as a whole (never edited at all)."""
    units = []
    protected = []
    whole = set()
    for repo in inv.repos:
        kept = matches(keep, repo.repo, repo.dirname)
        if repo.pinned or kept or repo.leased:
            whole.add(repo.dirname)
        for s in repo.snapshots:
            reason: Protection | None = (
                "pinned"
                if s.pinned
                else "keep"
                if kept
                else "leased"
                if s.leased
                else "foreign"
                if s.foreign
                else None
            )
            if reason is not None:
                protected.append(Protected(s.repo, s.commit, reason))
            units.append(
                Unit(
                    dirname=s.dirname,
                    commit=s.commit,
                    repo=s.repo,
                    complete=s.recorded,  # once: a quarantine's gap is no abandoned download
                    last_used=(s.last_used or 0.0) if s.recorded else s.last_activity,
                    blobs=s.blobs,
                    protected=reason,
                )
            )
    view = CacheView(
        now=now,
        units=tuple(units),
        blobs=tuple(Blob(b.sha256, b.nbytes, b.changed_at) for b in inv.blobs),
        leftovers=inv.partials + inv.junk,
        other_bytes=inv.foreign_bytes,
        free_bytes=inv.disk_free,
        leased_since=min((lease.created_at for lease in inv.leases), default=None),
        leased_blobs=frozenset(b for lease in inv.leases for b in lease.blobs),
    )
    return view, tuple(protected), frozenset(whole)


def _execute(
    cache: CacheStore,
    inv: Inventory,
    plan: PrunePlan,
    repo_protected: frozenset[str],
    *,
    now: float,
    stale_age: float,
) -> int:
    """Delete what the plan says, in reader-safe order; returns bytes planned but kept
    (a blob linked again meanwhile, a partial whose download resumed)."""
    kept_bytes = 0
    removal = CacheRemoval(cache)
    evicted = {(e.dirname, e.commit) for e in plan.evictions}
    for e in plan.evictions:
        removal.evict_snapshot(e.dirname, e.commit)
    doomed = set(plan.blobs)
    for repo in inv.repos:
        if repo.dirname in repo_protected:
            continue
        remaining = [s for s in repo.snapshots if (repo.dirname, s.commit) not in evicted]
        still = {e for s in remaining for e in s.etags}
        touched = len(remaining) < len(repo.snapshots)
        for etag, sha in sorted(repo.links.items()):
            if etag not in still and (touched or sha in doomed):
                removal.remove_repo_blob(repo.dirname, etag)
        if not remaining:
            removal.remove_repo_if_empty(repo.dirname)
    sizes = {b.sha256: b.nbytes for b in inv.blobs}
    for sha in plan.blobs:
        lock = cache.lock(sha)
        if not lock.try_acquire():
            kept_bytes += sizes.get(sha, 0)
            continue
        try:
            if removal.remove_blob(sha) == 0:
                kept_bytes += sizes.get(sha, 0)
        finally:
            lock.release()
    for leftover in plan.leftovers:
        if leftover.kind == "partial":
            if not remove_abandoned(cache, leftover.name, now - stale_age):
                kept_bytes += leftover.nbytes  # a download holds or resumed it
        else:
            removal.remove_junk(leftover.kind, leftover.name)
    remove_idle_locks(cache)
    forget_gone_blobs(cache.layout)
    return kept_bytes


def _report(
    plan: PrunePlan,
    limits: Limits,
    protected: tuple[Protected, ...],
    reaped: int,
    *,
    dry_run: bool,
    skipped_bytes: int,
) -> PruneReport:
    partials = [x for x in plan.leftovers if x.kind == "partial"]
    junk = [x for x in plan.leftovers if x.kind != "partial"]
    sizes = {e.dirname + e.commit: e.freed_bytes for e in plan.evictions}
    orphan_bytes = plan.freed_bytes - sum(sizes.values()) - sum(x.nbytes for x in plan.leftovers)
    return PruneReport(
        dry_run=dry_run,
        skipped=False,
        limits=limits,
        size_before=plan.size_before,
        size_after=plan.size_after + skipped_bytes,
        free_before=plan.free_before,
        free_after=plan.free_after,
        evicted=plan.evictions,
        partials=len(partials),
        partial_bytes=sum(x.nbytes for x in partials),
        orphans=len(plan.orphans),
        orphan_bytes=orphan_bytes,
        junk=len(junk),
        junk_bytes=sum(x.nbytes for x in junk),
        leases_reaped=reaped,
        protected=protected,
        unmet=plan.unmet,
    )


def _disk_free(cache: CacheStore) -> int | None:
    try:
        vfs = os.statvfs(cache.root)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def _quick_size(cache: CacheStore) -> int:
    found = survey(cache.root)
    return found.blob_bytes + found.partial_bytes
