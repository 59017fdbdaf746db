"""Training checkpoints from any origin: choose one, fetch one rank's files of it.

``prefetch_checkpoint`` is what ``shardsync prefetch SOURCE --checkpoint latest`` runs: the
engine's usual job (locks, verification, atomic publish, resume, leases), with its files
decided by ``shardsync.training`` instead of a weights index. ``latest`` says what would be
chosen without downloading anything but the small files the choice reads. The choice's
reads and the selection live in ``checkpoint_selection`` (what the scheduler is handed);
this module runs them on an engine, beside ``prefetch.prefetch``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

from shardsync.api import CheckpointResult
from shardsync.checkpoint_selection import CheckpointSelection, resolve
from shardsync.config import Config, load_config
from shardsync.fetch.request import Sleep
from shardsync.prefetch import Engine
from shardsync.records import ProgressSink
from shardsync.training import Choice

__all__ = ["alatest", "latest", "prefetch_checkpoint"]


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
