"""A snapshot's safetensors headers, read before any shard body lands.

A stream plans its devices from them. Whoever downloads reads them: the daemon when one
serves the stream (``POST /v1/prepare``, so the stream's process asks the origin nothing),
else the stream's own engine (``prefetch.Job.read_headers``). Parsing them is the caller's
(``safetensors_header``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from shardsync.errors import HeaderError, raise_first
from shardsync.manifest import ManifestEntry
from shardsync.safetensors_header import header_length

__all__ = ["read_headers"]

_PROBE = 64 * 1024  # one request usually covers the length prefix and the header

Cached = Callable[[ManifestEntry], Awaitable[Path | None]]
"""The cached blob of a file, or None: its header is read from there."""
ReadRange = Callable[[ManifestEntry, int, int], Awaitable[bytes]]
"""Bytes ``[start, end)`` of a file from its origin (fewer where the file ends)."""


async def read_headers(
    shards: Sequence[ManifestEntry], *, cached: Cached, read: ReadRange
) -> dict[str, bytes]:
    """Each safetensors shard's header (the bytes after its length prefix), by path: from
    its cached blob, else by Range requests (one of 64 KiB per shard, usually)."""

    async def one(entry: ManifestEntry) -> tuple[str, bytes]:
        blob = await cached(entry)
        if blob is not None:
            return entry.path, await asyncio.to_thread(_from_file, blob, entry.path)
        prefix = await read(entry, 0, _PROBE)
        n = header_length(prefix, shard=entry.path, file_size=entry.size)
        if len(prefix) < 8 + n:
            prefix += await read(entry, len(prefix), 8 + n)
        if len(prefix) < 8 + n:
            raise HeaderError(f"{entry.path}: file ends inside its header")
        return entry.path, prefix[8 : 8 + n]

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(e)) for e in shards if e.path.endswith(".safetensors")]
    except BaseExceptionGroup as group:
        raise_first(group)
    return dict(t.result() for t in tasks)


def _from_file(path: Path, shard: str) -> bytes:
    size = path.stat().st_size
    with path.open("rb") as f:
        n = header_length(f.read(8), shard=shard, file_size=size)
        return f.read(n)
