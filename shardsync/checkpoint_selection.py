"""A training checkpoint over an origin: the choice's small reads, one rank's selection.

``shardsync.training`` decides (pure); this reads what it asks for through an origin and
turns the choice into the files of one job: ``CheckpointSelection`` is the ``select`` hook
of ``Job.prepare`` and the result the choice makes of the download's. The scheduler gets
one per request from ``selection_for`` (its ``selections`` hook) and never asks what it is.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from shardsync.api import CheckpointResult, JobRequest
from shardsync.errors import EntryNotFoundError
from shardsync.manifest import Listing, Manifest, ManifestEntry, RemoteFile
from shardsync.origins.base import Http, Origin
from shardsync.records import PrefetchResult
from shardsync.training import Choice, Need, RankSelection, choose, select_rank

__all__ = ["CheckpointSelection", "ReadSmall", "local_folder", "resolve", "selection_for"]


ReadSmall = Callable[[Need], Awaitable[bytes | None]]
"""Reads the first ``need.limit + 1`` bytes of ``need.path`` at most (None: no such file)."""


async def resolve(
    origin: Origin,
    fetcher: Http,
    listing: Listing,
    checkpoint: str = "latest",
    *,
    read: ReadSmall | None = None,
    contents: dict[str, bytes | None] | None = None,
) -> Choice:
    """``training.choose`` over an origin: the small files it asks for are read by range
    (pass a listing made with ``hidden=True``: a DCP ``.metadata`` is a hidden file), by
    ``read`` when given (``DCPReader`` reads them through the cache), into ``contents``
    when given (what the choice was made from)."""
    pairs = [(f.path, f.size) for f in listing.files]
    contents = {} if contents is None else contents
    while isinstance(step := choose(pairs, checkpoint, contents), Need):
        if read is None:
            contents[step.path] = await _read_small(origin, fetcher, listing.commit, step)
        else:
            contents[step.path] = await read(step)
    return step


def _pinned(entry: ManifestEntry, read: bytes | None) -> ManifestEntry:
    """A file the choice was made from, read whole (a pointer, a ``.metadata``), is fetched
    as those bytes: one saved again since (``latest`` moved on by a training job still
    running) would name a checkpoint that was not fetched."""
    if read is None or entry.sha256 is not None or len(read) != entry.size:
        return entry
    return replace(entry, sha256=hashlib.sha256(read).hexdigest())


async def _read_small(
    origin: Origin, fetcher: Http, commit: str | None, need: Need
) -> bytes | None:
    try:
        return await origin.read_range(
            fetcher, commit, RemoteFile(need.path, None, None), 0, need.limit + 1
        )
    except EntryNotFoundError:
        return None


class CheckpointSelection:
    """One rank's files of a chosen training checkpoint, in place of a weights index: the
    ``select`` hook of ``Job.prepare``, and the result that choice makes of the download's.

    The scheduler receives one from ``selection_for`` per request and never asks what it is.
    """

    def __init__(
        self,
        origin: Origin,
        fetcher: Http,
        checkpoint: str,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._origin, self._fetcher = origin, fetcher
        self._checkpoint, self._rank, self._world_size = checkpoint, rank, world_size
        self._choice: Choice | None = None
        self._selection: RankSelection | None = None

    async def select(self, listing: Listing) -> Manifest:
        read: dict[str, bytes | None] = {}
        choice = await resolve(
            self._origin, self._fetcher, listing, self._checkpoint, contents=read
        )
        selection = select_rank(choice, self._rank, self._world_size)
        listed = {f.path: f for f in listing.files}
        entries = tuple(
            _pinned(ManifestEntry.from_remote(listed[path], "shard"), read.get(path))
            if path in listed
            else ManifestEntry(path, size, None, None, "shard")
            for path, size in selection.files
        )
        self._choice, self._selection = choice, selection
        return Manifest(commit=listing.commit, entries=entries, weight_map={})

    def result(self, prefetch: PrefetchResult) -> CheckpointResult:
        """The finished job's result; only after ``select`` ran."""
        if self._choice is None or self._selection is None:
            raise RuntimeError("CheckpointSelection.result before select")
        choice = self._choice
        return CheckpointResult(
            prefetch=prefetch,
            checkpoint=choice.name,
            format=choice.format,
            step=choice.step,
            path=local_folder(prefetch.snapshot_path, choice.root),
            skipped=choice.skipped,
            notes=self._selection.notes,
        )

    def result_json(self, prefetch: PrefetchResult) -> dict[str, Any]:
        """What a daemon job's ``job_done`` carries (``CheckpointResult.to_json``)."""
        return self.result(prefetch).to_json()


def selection_for(request: JobRequest, origin: Origin, fetcher: Http) -> CheckpointSelection | None:
    """The scheduler's ``selections`` hook: a checkpoint request's selection (None: the
    request is for the weights the index names)."""
    if request.checkpoint is None:
        return None
    return CheckpointSelection(
        origin, fetcher, request.checkpoint, request.rank, request.world_size
    )


def local_folder(snapshot: Path, root: str) -> Path:
    return snapshot.joinpath(*posixpath.normpath(root).split("/")) if root else snapshot
