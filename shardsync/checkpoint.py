"""Training checkpoints from any origin: choose one, fetch one rank's files of it.

``prefetch_checkpoint`` is what ``shardsync prefetch SOURCE --checkpoint latest`` runs: the
engine's usual job (locks, verification, atomic publish, resume, leases), with its files
decided by ``shardsync.training`` instead of a weights index. ``latest`` says what would be
chosen without downloading anything but the small files the choice reads.
"""

from __future__ import annotations

import asyncio
import posixpath
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from shardsync.api import CheckpointResult, JobRequest
from shardsync.config import Config, load_config
from shardsync.errors import EntryNotFoundError
from shardsync.fetch.fetcher import Fetcher
from shardsync.fetch.request import Sleep
from shardsync.manifest import Listing, Manifest, ManifestEntry, RemoteFile
from shardsync.origins import Origin
from shardsync.prefetch import Engine
from shardsync.records import PrefetchResult, ProgressSink
from shardsync.training import (
    Choice,
    Need,
    RankSelection,
    choose,
    select_rank,
)

__all__ = [
    "CheckpointSelection",
    "alatest",
    "latest",
    "prefetch_checkpoint",
    "resolve",
    "selection_for",
]


ReadSmall = Callable[[Need], Awaitable[bytes | None]]
"""Reads the first ``need.limit + 1`` bytes of ``need.path`` at most (None: no such file)."""


async def resolve(
    origin: Origin,
    fetcher: Fetcher,
    listing: Listing,
    checkpoint: str = "latest",
    *,
    read: ReadSmall | None = None,
) -> Choice:
    """``training.choose`` over an origin: the small files it asks for are read by range
    (pass a listing made with ``hidden=True``: a DCP ``.metadata`` is a hidden file), by
    ``read`` when given (``DCPReader`` reads them through the cache)."""
    pairs = [(f.path, f.size) for f in listing.files]
    contents: dict[str, bytes | None] = {}
    while isinstance(step := choose(pairs, checkpoint, contents), Need):
        if read is None:
            contents[step.path] = await _read_small(origin, fetcher, listing.commit, step)
        else:
            contents[step.path] = await read(step)
    return step


async def _read_small(
    origin: Origin, fetcher: Fetcher, commit: str | None, need: Need
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
        fetcher: Fetcher,
        checkpoint: str,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self._origin, self._fetcher = origin, fetcher
        self._checkpoint, self._rank, self._world_size = checkpoint, rank, world_size
        self._choice: Choice | None = None
        self._selection: RankSelection | None = None

    async def select(self, listing: Listing) -> Manifest:
        choice = await resolve(self._origin, self._fetcher, listing, self._checkpoint)
        selection = select_rank(choice, self._rank, self._world_size)
        listed = {f.path: f for f in listing.files}
        entries = tuple(
            ManifestEntry.from_remote(listed[path], "shard")
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


def selection_for(
    request: JobRequest, origin: Origin, engine: Engine
) -> CheckpointSelection | None:
    """The scheduler's ``selections`` hook: a checkpoint request's selection (None: the
    request is for the weights the index names)."""
    if request.checkpoint is None:
        return None
    return CheckpointSelection(
        origin, engine.fetcher, request.checkpoint, request.rank, request.world_size
    )


async def prefetch_checkpoint(
    source: str,
    config: Config,
    *,
    checkpoint: str = "latest",
    rank: int | None = None,
    world_size: int | None = None,
    token: str | None = None,
    progress: ProgressSink | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = asyncio.sleep,
) -> CheckpointResult:
    """Make ``checkpoint`` of the training run at ``source`` (or rank ``rank``'s part of it)
    complete in the cache and return where it is."""
    started = time.monotonic()
    engine = Engine(config, sleep=sleep, environ=environ)
    origin = engine.origin(source, token=token)
    async with engine:
        selection = CheckpointSelection(origin, engine.fetcher, checkpoint, rank, world_size)
        job = engine.job(origin, sink=progress)
        await job.prepare(select=selection.select)
        result = job.result(await job.download(), time.monotonic() - started)
    return selection.result(job.after_uploads(result))


def local_folder(snapshot: Path, root: str) -> Path:
    return snapshot.joinpath(*posixpath.normpath(root).split("/")) if root else snapshot


async def alatest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """What ``--checkpoint latest`` (or ``checkpoint``) would choose at ``source``, with the
    checkpoints passed over and why; downloads nothing but the small files it reads."""
    config = config or load_config(None, cache_dir=cache_dir)
    engine = Engine(config)
    origin = engine.origin(source, token=token)
    async with engine:
        listing = await origin.list_files(engine.fetcher, origin.default_revision, hidden=True)
        return await resolve(origin, engine.fetcher, listing, checkpoint)


def latest(
    source: str,
    *,
    checkpoint: str = "latest",
    config: Config | None = None,
    cache_dir: Path | None = None,
    token: str | None = None,
) -> Choice:
    """Blocking ``alatest`` (not from inside a running event loop)."""
    return asyncio.run(
        alatest(source, checkpoint=checkpoint, config=config, cache_dir=cache_dir, token=token)
    )
