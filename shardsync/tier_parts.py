"""A claim holder's parts: what it has downloaded of a blob, in the tier while it downloads,
so that a host taking over its claim after it died resumes instead of starting over.

Key layout (part of the tier's contract, see ``tier``)::

    PREFIX/parts/<sha256>/<start>-<end>   bytes [start, end) of the blob with that sha256

The holder publishes each ``part_size``-aligned block but the last once its resume record
says the block is on disk (the record trails the file by a fraction of a second), so a holder
killed at 40% costs the fleet the blocks it had not finished, not 40% of the blob. A taker
writes the parts into a seeded partial (``Slot.seed``) and downloads only the rest from the
origin. Nothing of a part is trusted: the taker's download hashes the whole file, parts
included, and a mismatch deletes the parts and costs one more download from the origin, never
a wrong blob. The parts are deleted by whoever uploads the blob; a lifecycle rule on ``parts/``
collects those of a fleet that died entirely (README: Fleet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable

from shardsync.errors import ShardsyncError
from shardsync.s3 import S3Client, S3Location
from shardsync.slot import Slot

__all__ = ["delete_parts", "parts_prefix", "publish_parts", "seed_from_parts"]

log = logging.getLogger("shardsync.tier")

_LOOK_S = 0.5  # seconds between looks at the holder's resume record
_MAX_PARTS = 100_000
_PART_NAME = re.compile(r"(0|[1-9][0-9]{0,15})-([1-9][0-9]{0,15})")


def parts_prefix(prefix: str, sha256: str) -> str:
    return f"{prefix}parts/{sha256}/"


async def publish_parts(
    client: S3Client,
    where: S3Location,
    sha256: str,
    size: int,
    part_size: int,
    slot: Slot,
    downloading: Callable[[], bool],
) -> None:
    """While ``downloading()``: upload every block of ``part_size`` the slot's partial holds,
    once each. Runs until cancelled or the download ends; a failed request ends it (the tier
    counts it where the caller runs it)."""
    published: set[int] = set()
    blocks = range(0, size - part_size, part_size)  # not the last: the blob itself follows
    while downloading() and len(published) < len(blocks):
        await asyncio.sleep(_LOOK_S)
        landed = await asyncio.to_thread(slot.landed)
        if landed is None:
            continue
        for start in blocks:
            end = start + part_size
            if start in published or not landed.contains(start, end) or not downloading():
                continue
            try:
                data = await asyncio.to_thread(slot.read, start, end - start)
            except OSError:
                return  # the partial is gone: published, or given up
            if len(data) != end - start:
                return
            key = f"{parts_prefix(where.prefix, sha256)}{start}-{end}"
            await client.put_bytes(where.bucket, key, data)
            published.add(start)


async def seed_from_parts(
    client: S3Client, where: S3Location, sha256: str, size: int, slot: Slot
) -> int:
    """Write the parts another holder left for ``sha256`` into a seeded partial in ``slot``;
    the bytes seeded (0 when there are none, or the slot has a partial of its own)."""
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
        return 0
    seeding = await asyncio.to_thread(slot.seed, size, sha256)
    if seeding is None:
        return 0
    try:
        reached = 0  # parts overlapping one already written are skipped: one copy of a byte
        for start, end, key in sorted(parts):
            if start < reached:
                continue
            try:
                data, _ = await client.get_small(where.bucket, key, max_size=end - start)
            except ShardsyncError as exc:
                log.info("tier part %s unreadable (%s); the origin sends it", key, exc)
                continue
            if len(data) != end - start:
                continue
            await asyncio.to_thread(seeding.write, start, data)
            reached = end
    finally:
        await asyncio.to_thread(seeding.close)
    return seeding.written


async def delete_parts(client: S3Client, where: S3Location, sha256: str) -> None:
    """Remove the parts of a blob that is in the tier now (best effort: a lifecycle rule
    collects what is left)."""
    listing = S3Location(where.bucket, parts_prefix(where.prefix, sha256))
    for info in await client.list(listing, max_keys=_MAX_PARTS):
        with contextlib.suppress(ShardsyncError):
            await client.delete(where.bucket, info.key)
