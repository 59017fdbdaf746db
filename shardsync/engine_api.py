"""The engine as the scheduler runs it: protocols, so the two sit side by side.

``prefetch.Engine`` and its ``Job`` have these shapes, and ``prune.CacheRoom`` is the
``Room``; the scheduler names only these, so it rests on the transfer layer's values, not
on the engine, and a composer (the daemon, the client's in-process fallback) hands it both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from shardsync.config import Config
from shardsync.events import Verified
from shardsync.manifest import Listing, Manifest, ManifestEntry
from shardsync.origins.base import Http, Origin
from shardsync.records import FileOutcome, PrefetchResult, ProgressSink, TierStatistics

__all__ = ["EngineJob", "FileGate", "Room", "Runner", "Select"]

Select = Callable[[Listing], Awaitable[Manifest]]
"""Decides a job's files from the origin's listing instead of the weights index (a training
checkpoint's files: ``checkpoint_selection``)."""


class FileGate(Protocol):
    """Admits one file of a job at a time per slot: the daemon's scheduler orders files of
    all jobs by priority with it, and learns which file started and which failed."""

    def __call__(
        self, entry: ManifestEntry, position: int
    ) -> AbstractAsyncContextManager[None]: ...


class EngineJob(Protocol):
    """One run of one snapshot (``prefetch.Job``)."""

    in_order: bool  # a client streams it: each shard in its turn
    commit: str  # the snapshot's commit once prepared ("" while unknown)

    @property
    def uploading(self) -> bool:
        """Whether uploads it owes the fleet's tier still run."""

    async def prepare(
        self,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        *,
        select: Select | None = None,
    ) -> Manifest:
        """Decide every file to fetch, in order."""

    async def download(self) -> tuple[FileOutcome, ...]:
        """Fetch (or reuse) every file; the snapshot is complete when this returns."""

    async def adopt(self) -> None:
        """Name the snapshot another job completed by this job's revision too."""

    def result(
        self, files: tuple[FileOutcome, ...], elapsed: float, *, counters: bool = True
    ) -> PrefetchResult:
        """What ``download`` returned, as a caller's result."""

    def tier_statistics(self) -> TierStatistics | None:
        """What the tier did for this job alone."""

    def verified(self, outcome: FileOutcome, shard_index: int | None) -> Verified:
        """The ``Verified`` event of a file this job reports done."""


class Runner(Protocol):
    """The engine every job of a scheduler runs on (``prefetch.Engine``)."""

    @property
    def config(self) -> Config:
        """The settings it was built with."""

    @property
    def fetcher(self) -> Http:
        """What origins and selections read through."""

    def origin(self, source: str, *, token: str | None = None) -> Origin:
        """The origin ``source`` names, one per source for the engine's life."""

    def job(
        self,
        origin: Origin,
        *,
        revision: str | None = None,
        allow_pickle: bool = False,
        sink: ProgressSink | None = None,
        gate: FileGate | None = None,
        in_order: bool = False,
    ) -> EngineJob:
        """A new run of ``origin`` at ``revision``."""


class Room(Protocol):
    """Disk space for jobs (``prune.CacheRoom``): the scheduler says when, the pruner how."""

    async def tidy(self, keep: str) -> None:
        """Past the cache's high-water mark, prune down to its limits, ``keep``'s repo kept."""

    async def make(
        self, entries: Iterable[ManifestEntry], keep: str, on_short: Callable[[int, int], None]
    ) -> None:
        """Room for ``entries`` (pruning, ``keep``'s repo kept, after telling ``on_short``
        the bytes needed and free), or ``DiskFullError``."""
