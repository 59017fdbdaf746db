"""Which snapshots and leftovers a prune removes: a pure plan from a picture of the cache.

No I/O here: ``prune.py`` takes the picture (``inventory.scan``), calls ``plan_prune`` and
carries the plan out. The rules, in the order they apply:

1. Protected snapshots are never touched: pinned repos, ``--keep`` repos, anything under a
   live lease, and snapshots holding files shardsync did not write (``foreign``).
2. Stale leftovers go whatever the limits: partial downloads, ``tmp/`` and ``quarantine/``
   entries, store blobs no snapshot refers to, and snapshots that never completed (a
   quarantine's gap is not one: the next prefetch fills it), all untouched for
   ``stale_age``; a blob no snapshot refers to yet is kept while a lease older than it lives
   (a long job links content-named files only at its end).
3. ``max_age``: every snapshot not used for that long.
4. Least recently used first, until the cache is at most ``max_size`` and the filesystem has
   ``min_free``; before any snapshot, every store blob no snapshot refers to (one a prune
   killed midway left unlinked), but those newer than the oldest live lease. A snapshot
   whose every blob a protected one also holds would free nothing and is skipped here.

A blob is freed when the last snapshot referring to it goes, unless a live lease names it (a
content-named job reusing another repo's blob); sizes are bytes on disk with every blob
counted once, however many snapshots and repos share it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

__all__ = [
    "Blob",
    "CacheView",
    "Eviction",
    "Leftover",
    "Limits",
    "PrunePlan",
    "Unit",
    "matches",
    "plan_prune",
]

Reason = Literal["stale", "max_age", "max_size", "min_free"]
Protection = Literal["pinned", "keep", "leased", "foreign"]
Limit = Literal["max_size", "min_free"]
LeftoverKind = Literal["partial", "tmp", "quarantine"]


@dataclass(frozen=True, slots=True)
class Limits:
    """What a prune aims for; None means no such limit."""

    max_size: int | None = None  # bytes on disk of the whole cache
    min_free: int | None = None  # bytes free on the cache's filesystem
    max_age: float | None = None  # seconds since last use
    stale_age: float = 86400.0  # seconds untouched before leftovers count as abandoned

    def __post_init__(self) -> None:
        for name in ("max_size", "min_free", "max_age"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative")
        if not self.stale_age >= 0:
            raise ValueError("stale_age must not be negative")


@dataclass(frozen=True, slots=True)
class Unit:
    """One snapshot as the planner sees it."""

    dirname: str
    commit: str
    repo: str
    complete: bool  # completed once (a record), whatever a quarantine took from it since
    last_used: float  # the LRU clock: last use, or last activity of an incomplete one
    blobs: frozenset[str]  # ids (sha256) of the store blobs it refers to
    protected: Protection | None = None


@dataclass(frozen=True, slots=True)
class Blob:
    """One store blob: its id, bytes on disk, and when its links last changed."""

    id: str
    nbytes: int
    changed_at: float


@dataclass(frozen=True, slots=True)
class Leftover:
    """A partial download (by key), or an entry of ``tmp/`` or ``quarantine/``."""

    kind: LeftoverKind
    name: str
    nbytes: int
    modified_at: float


@dataclass(frozen=True, slots=True)
class CacheView:
    """Everything ``plan_prune`` decides from."""

    now: float
    units: tuple[Unit, ...]
    blobs: tuple[Blob, ...]
    leftovers: tuple[Leftover, ...] = ()
    other_bytes: int = 0  # counted in the size, never freed (files shardsync did not write)
    free_bytes: int | None = None  # None: unknown, so min_free cannot be judged
    # when the oldest live lease was taken (None: none): a job holding one may have published
    # blobs it links only at its end (content-named snapshots), so none newer is an orphan
    leased_since: float | None = None
    # blobs a live lease names: a content-named job counts on them before it links them
    leased_blobs: frozenset[str] = frozenset()

    @property
    def total_bytes(self) -> int:
        return (
            sum(b.nbytes for b in self.blobs)
            + sum(x.nbytes for x in self.leftovers)
            + self.other_bytes
        )


@dataclass(frozen=True, slots=True)
class Eviction:
    """One snapshot to remove, why, and the blobs whose last reference it drops."""

    dirname: str
    commit: str
    repo: str
    reason: Reason
    blobs: tuple[str, ...]
    freed_bytes: int


@dataclass(frozen=True, slots=True)
class PrunePlan:
    evictions: tuple[Eviction, ...]
    orphans: tuple[str, ...]  # stale store blobs no snapshot refers to
    leftovers: tuple[Leftover, ...]
    size_before: int
    size_after: int
    free_before: int | None
    free_after: int | None
    unmet: tuple[Limit, ...]  # limits that still do not hold once everything allowed is gone

    @property
    def blobs(self) -> tuple[str, ...]:
        """Every store blob to unlink, evictions' first."""
        return tuple(b for e in self.evictions for b in e.blobs) + self.orphans

    @property
    def freed_bytes(self) -> int:
        return self.size_before - self.size_after


def plan_prune(view: CacheView, limits: Limits) -> PrunePlan:
    """Decide what to remove; see the module docstring for the rules."""
    sizes = {b.id: b.nbytes for b in view.blobs}
    refs: Counter[str] = Counter(b for u in view.units for b in u.blobs if b in sizes)
    refs.update(b for b in view.leased_blobs if b in sizes)  # a reference no eviction drops
    held = {b for u in view.units if u.protected is not None for b in u.blobs}
    held |= view.leased_blobs
    stale_cut = view.now - limits.stale_age
    freed = 0

    leftovers = tuple(x for x in view.leftovers if x.modified_at < stale_cut)
    orphan_cut = stale_cut if view.leased_since is None else min(stale_cut, view.leased_since)
    orphans = tuple(
        sorted(b.id for b in view.blobs if refs[b.id] == 0 and b.changed_at < orphan_cut)
    )
    freed += sum(x.nbytes for x in leftovers) + sum(sizes[b] for b in orphans)

    evictions: list[Eviction] = []
    remaining = sorted(
        (u for u in view.units if u.protected is None),
        key=lambda u: (u.last_used, u.dirname, u.commit),
    )

    def evict(unit: Unit, reason: Reason) -> None:
        nonlocal freed
        gone = []
        for blob in sorted(unit.blobs):
            if blob in refs:
                refs[blob] -= 1
                if refs[blob] == 0:
                    gone.append(blob)
        nbytes = sum(sizes[b] for b in gone)
        freed += nbytes
        evictions.append(
            Eviction(unit.dirname, unit.commit, unit.repo, reason, tuple(gone), nbytes)
        )
        remaining.remove(unit)

    for unit in [u for u in remaining if not u.complete and u.last_used < stale_cut]:
        evict(unit, "stale")
    if limits.max_age is not None:
        age_cut = view.now - limits.max_age
        for unit in [u for u in remaining if u.last_used < age_cut]:
            evict(unit, "max_age")

    size_before = view.total_bytes

    def unmet() -> tuple[Limit, ...]:
        missing: list[Limit] = []
        if limits.max_size is not None and size_before - freed > limits.max_size:
            missing.append("max_size")
        if (
            limits.min_free is not None
            and view.free_bytes is not None
            and view.free_bytes + freed < limits.min_free
        ):
            missing.append("min_free")
        return tuple(missing)

    if unmet():  # before any snapshot: blobs nothing refers to (a killed prune's), but a job's
        young = [b for b in view.blobs if refs[b.id] == 0 and b.id not in orphans]
        young = [b for b in young if view.leased_since is None or b.changed_at < view.leased_since]
        orphans = tuple(sorted((*orphans, *(b.id for b in young))))
        freed += sum(b.nbytes for b in young)
    for unit in list(remaining):
        over = unmet()
        if not over:
            break
        if unit.blobs and unit.blobs <= held:
            continue  # a protected snapshot keeps every byte of it: removing frees nothing
        evict(unit, over[0])

    return PrunePlan(
        evictions=tuple(evictions),
        orphans=orphans,
        leftovers=leftovers,
        size_before=size_before,
        size_after=size_before - freed,
        free_before=view.free_bytes,
        free_after=None if view.free_bytes is None else view.free_bytes + freed,
        unmet=unmet(),
    )


def matches(patterns: Iterable[str], *names: str) -> bool:
    """Whether any ``fnmatch`` pattern (``org/*``) matches any of ``names`` (case-sensitive).
    A trailing ``/`` counts on neither side: ``s3://b/p`` names the prefix stored as
    ``s3://b/p/``, and ``/models/llama/`` the folder stored as ``/models/llama``."""
    return any(fnmatchcase(name.rstrip("/"), p.rstrip("/")) for p in patterns for name in names)
