"""A claim holder's parts: what it has downloaded of a blob, in the tier while it downloads,
so that a host taking over its claim after it died resumes instead of starting over.

Key layout (part of the tier's contract, see ``tier``)::

    PREFIX/parts/<sha256>/<start>-<end>   bytes [start, end) of the blob with that sha256

The holder publishes what its resume record says is on disk (the record trails the file by a
fraction of a second), in pieces of ``part_size`` along each connection's range and their
short tails every second. Its download is held within ``Lead.limit`` of what the tier has
taken (a tier ingesting slower than the origin sends sets the pace), so a holder killed at
40% costs the fleet that lead and what its sockets held, not 40% of the blob. A taker
writes the parts into a seeded partial (``Slot.seed``) and downloads only the rest from the
origin. Nothing of a part is trusted: the taker's download hashes the whole file, parts
included, and a mismatch deletes the parts and costs one more download from the origin, never
a wrong blob. The parts are deleted by whoever uploads the blob; a lifecycle rule on ``parts/``
collects those of a fleet that died entirely (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable

from shardsync.errors import ShardsyncError, raise_first
from shardsync.names import S3Location
from shardsync.ranges import RangeSet
from shardsync.s3 import S3Client
from shardsync.slot import Seeding, Slot
from shardsync.tasks import opened, to_the_end

__all__ = [
    "Lead",
    "delete_parts",
    "next_pieces",
    "parts_prefix",
    "publish_parts",
    "seed_from_parts",
]

log = logging.getLogger("shardsync.tier")

_LOOK_S = 0.25  # seconds between looks at the holder's resume record
_FLUSH_S = 1.0  # seconds between uploads of the runs' tails, whatever their length
_WRITERS = 4  # pieces a holder uploads at once, per blob
_MAX_PARTS = 100_000
_READERS = 8  # parts read at once by a taker
_HOLD_S = 0.02  # how long a held read pauses before it asks again
_PATIENCE_S = 5.0  # a held download waits this long for the tier to take a part, then not
_PART_NAME = re.compile(r"(0|[1-9][0-9]{0,15})-([1-9][0-9]{0,15})")


def parts_prefix(prefix: str, sha256: str) -> str:
    return f"{prefix}parts/{sha256}/"


class Lead:
    """How far a claim holder's download may run ahead of its parts: a ``fetch.Throttle``
    that pauses the download's reads while more than ``limit`` bytes of it are not in the
    tier yet, so what a ``kill -9`` loses is bounded by the lead, not by how much slower the
    tier takes parts than the origin sends them (on a busy 2-core box SeaweedFS took them at
    20 MB/s from a holder reading 50: bench/README.md, Under faults). A tier that takes
    nothing for ``patience`` seconds while the download waits is given up on for this
    download: it goes on unpaced (the tier's own timeouts report the failure). Thread-safe:
    the pump's thread reads, the event loop publishes."""

    def __init__(
        self,
        limit: int,
        *,
        patience: float = _PATIENCE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._patience = patience
        self._clock = clock
        self._lock = threading.Lock()
        self._read = 0  # body bytes the download read
        self._settled = 0  # of those, in the tier (or never to be)
        self._since = 0.0  # when the download was held, or the tier last took a part since
        self._free = False
        self.held = False  # the download waits: publish what landed now, tails and all

    @classmethod
    def of_parts(cls, part_size: int) -> Lead:
        """Two rounds of the publisher's writers ahead: what a ``kill -9`` may cost."""
        return cls(2 * _WRITERS * part_size)

    def __call__(self, nbytes: int) -> float:
        with self._lock:
            self._read += nbytes
            if self._free or self._read - self._settled <= self.limit:
                self.held = False
                return 0.0
            now = self._clock()
            if not self.held:
                self.held, self._since = True, now
            elif now - self._since > self._patience:
                log.info("the tier took no part for %.0f s: on unpaced", now - self._since)
                self._free, self.held = True, False
                return 0.0
            return _HOLD_S

    def settled(self, nbytes: int) -> None:
        """``nbytes`` of the download are in the tier now, or never will be (unreadable)."""
        with self._lock:
            self._settled += nbytes
            self._since = self._clock()

    def release(self) -> None:
        """Publishing ended: the download goes on at the origin's pace."""
        with self._lock:
            self._free, self.held = True, False


async def publish_parts(
    client: S3Client,
    where: S3Location,
    sha256: str,
    size: int,
    part_size: int,
    slot: Slot,
    downloading: Callable[[], bool],
    *,
    there: RangeSet | None = None,
    lead: Lead | None = None,
) -> None:
    """While ``downloading()``: upload what the slot's partial holds that is not published
    yet, in pieces of at most ``part_size`` along each connection's run (pieces follow the
    landed runs, not aligned blocks), ``_WRITERS`` at a time, a piece going out as soon as a
    writer is free. Every ``_FLUSH_S`` the runs' short tails go out too, so a holder killed
    at 40% has published all but about a second and its uploads in flight, however slow its
    connections (a 4 MiB piece at 2 MB/s took 2 s to fill; bench/README.md: Under faults).
    Runs until cancelled or the download ends; a failed request ends it (the caller counts
    it). ``there`` is what the tier holds already (the parts a taker seeded from): never
    uploaded again. ``lead`` hears of each part taken, flushes the tails at once while it
    holds the download back, and is released when publishing ends."""
    decided = RangeSet() if there is None else there.copy()  # published, or on its way
    gate = asyncio.Semaphore(_WRITERS)

    async def put(first: int, stop: int) -> None:
        async with gate:
            if not downloading():
                return
            try:
                data = await asyncio.to_thread(slot.read, first, stop - first)
            except OSError:
                data = b""  # the partial is gone: published, or given up
            if len(data) == stop - first:
                key = f"{parts_prefix(where.prefix, sha256)}{first}-{stop}"
                await client.put_bytes(where.bucket, key, data)
            if lead is not None:
                lead.settled(stop - first)

    looks = 0
    try:
        async with asyncio.TaskGroup() as tg:
            while downloading():
                await asyncio.sleep(_LOOK_S)
                looks += 1
                landed = await asyncio.to_thread(slot.landed)
                held = lead is not None and lead.held
                if landed is None and lead is not None and held:
                    lead.release()  # no record to publish from: nothing to wait for
                if landed is None or landed.total() >= size:
                    continue  # no record to trust, or the whole file: the blob itself follows
                flush = held or looks % round(_FLUSH_S / _LOOK_S) == 0
                for first, stop in next_pieces(landed, decided, size, part_size, flush=flush):
                    decided.add(first, stop)
                    tg.create_task(put(first, stop))
    except BaseExceptionGroup as group:
        raise_first(group)  # the request's own error, as a single request raises it
    finally:
        if lead is not None:
            lead.release()


def next_pieces(
    landed: RangeSet, published: RangeSet, size: int, part_size: int, *, flush: bool = False
) -> list[tuple[int, int]]:
    """What to publish next: the landed bytes not yet published, in pieces of ``part_size``,
    and a shorter last piece of a run where the run can grow no more, or on ``flush``."""
    out: list[tuple[int, int]] = []
    for start, end in landed.to_list():
        for first, stop in _minus(start, end, published):
            closed = flush or stop == size or published.contains(stop, stop + 1)
            while stop - first >= part_size or (closed and stop > first):
                piece = min(first + part_size, stop)
                out.append((first, piece))
                first = piece
    return out


def _minus(start: int, end: int, done: RangeSet) -> list[tuple[int, int]]:
    """``[start, end)`` less what ``done`` holds, in order."""
    return [(max(a, start), min(b, end)) for a, b in done.missing(end) if b > start]


async def seed_from_parts(
    client: S3Client, where: S3Location, sha256: str, size: int, slot: Slot
) -> RangeSet:
    """Write the parts another holder left for ``sha256`` into a seeded partial in ``slot``;
    the ranges seeded (none when there are no parts, or the slot has a partial of its own)."""
    listing = S3Location(where.bucket, parts_prefix(where.prefix, sha256))
    found = await client.list(listing, max_keys=_MAX_PARTS)
    parts: list[tuple[int, int, str]] = []
    for info in found:
        match = _PART_NAME.fullmatch(info.key.removeprefix(listing.prefix))
        if match is None:
            continue
        start, end = int(match[1]), int(match[2])
        if start < end <= size and info.size == end - start:
            parts.append((start, end, info.key))
    if not parts:
        return RangeSet()
    # to its end, closed if the job was cancelled meanwhile: a partial opened in a thread
    # no one waits for would keep its descriptors for the life of the process
    seeding = await opened(asyncio.to_thread(slot.seed, size, sha256), Seeding.close)
    if seeding is None:
        return RangeSet()
    chosen, reached = [], 0  # parts overlapping one chosen are skipped: one copy of a byte
    for start, end, key in sorted(parts):
        if start >= reached:
            chosen.append((start, end, key))
            reached = end
    gate = asyncio.Semaphore(_READERS)

    async def read(start: int, end: int, key: str) -> None:
        async with gate:
            try:
                data, _ = await client.get_small(where.bucket, key, max_size=end - start)
            except ShardsyncError as exc:
                log.info("tier part %s unreadable (%s); the origin sends it", key, exc)
                return
            if len(data) == end - start:
                # to its end even when cancelled: the descriptor is closed once no write
                # runs (a closed number is the next file's, and a late write would land there)
                await to_the_end(asyncio.to_thread(seeding.write, start, data))

    try:
        async with asyncio.TaskGroup() as tg:
            for start, end, key in chosen:
                tg.create_task(read(start, end, key))
    except BaseExceptionGroup as group:
        raise_first(group)  # a full disk is the job's error, as it is without parts
    finally:
        await to_the_end(asyncio.to_thread(seeding.close))
    return seeding.written


async def delete_parts(client: S3Client, where: S3Location, sha256: str) -> None:
    """Remove the parts of a blob that is in the tier now (best effort: a lifecycle rule
    collects what is left)."""
    listing = S3Location(where.bucket, parts_prefix(where.prefix, sha256))
    found = await client.list(listing, max_keys=_MAX_PARTS)
    if found:
        await client.delete_many(where.bucket, [info.key for info in found])
