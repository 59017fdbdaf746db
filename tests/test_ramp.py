"""The connection ramp: climb while each step brings more bytes per second, undo the first
step that does not, and stop there."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from helpers import SendBody, fast_config, random_shard, range_server

from shardsync.prefetch import prefetch
from shardsync.ramp import ConnectionRamp


def climb(ramp: ConnectionRamp, rate_of: dict[int, float] | None = None) -> list[int]:
    """Counts the ramp holds, interval by interval, when ``count`` connections bring
    ``rate_of(count)`` (default: 25 MB/s each, a per-connection cap with room to spare)."""
    counts = [ramp.count]
    for _ in range(20):
        rate = rate_of[ramp.count] if rate_of else 25e6 * ramp.count
        counts.append(ramp.observe(rate))
    return counts


def test_starts_with_a_quarter_or_all_of_up_to_four() -> None:
    assert ConnectionRamp(32).count == 8
    assert ConnectionRamp(16).count == 4
    assert ConnectionRamp(8).count == 4
    assert ConnectionRamp(2).count == 2
    assert ConnectionRamp(1).count == 1


def test_climbs_by_half_while_each_step_pays() -> None:
    # each count: one interval skipped while new connections start, two measured
    counts = climb(ConnectionRamp(16))
    assert counts[:13] == [4, 4, 4, 6, 6, 6, 9, 9, 9, 13, 13, 13, 16]
    assert set(counts[13:]) == {16}


def test_a_step_that_brings_nothing_is_undone_then_tried_again_later() -> None:
    # past 6 connections this host takes no more: 9 bring what 6 did
    rates = {4: 100e6, 6: 150e6, 9: 150e6, 13: 150e6}
    counts = climb(ConnectionRamp(16, pause=4), rates)
    # 9 is looked at for two intervals more before it is undone
    assert counts[:15] == [4, 4, 4, 6, 6, 6, 9, 9, 9, 9, 9, 6, 6, 6, 6]
    assert max(counts[13:]) == 9 and counts[-1] in (6, 9)


def test_a_step_is_kept_when_a_longer_look_shows_it_paid() -> None:
    """One low look (a burst missed) is not enough to undo a step: the next two decide."""
    ramp = ConnectionRamp(16)
    counts = [ramp.observe(rate) for rate in (0, 100e6, 100e6, 0, 110e6, 110e6, 190e6, 190e6)]
    assert counts == [4, 4, 6, 6, 6, 6, 9, 9]  # the third look tips the average: kept
    assert ramp.observe(0) == 9


def test_a_step_must_bring_half_of_its_proportional_gain() -> None:
    # 4 -> 6 is +50% connections: it must bring at least +25%
    short = climb(ConnectionRamp(16), {4: 100e6, 6: 124e6})
    assert 9 not in short and short[8] == 4  # undone after its trial, never built on
    assert climb(ConnectionRamp(16), {4: 100e6, 6: 126e6, 9: 126e6})[-1] in (6, 9)
    assert 4 not in climb(ConnectionRamp(16), {4: 100e6, 6: 126e6, 9: 126e6})[6:]


def test_up_to_four_connections_never_climb() -> None:
    assert set(climb(ConnectionRamp(1))) == {1}
    assert set(climb(ConnectionRamp(4))) == {4}


# ------------------------------------------------------------------ a real download, ramped


def paced(
    data: bytes, pace: Callable[[int], Awaitable[None]], seen: list[tuple[float, int]]
) -> SendBody:
    """Bodies in 64 KiB pieces, each after ``pace(len(piece))``; ``seen`` gets (time, bodies
    in flight) as each body starts."""
    flowing = 0

    async def send(response: web.StreamResponse, first: int, last: int) -> None:
        nonlocal flowing
        flowing += 1
        seen.append((time.monotonic(), flowing))
        try:
            for pos in range(first, last + 1, 64 << 10):
                piece = data[pos : min(last + 1, pos + (64 << 10))]
                await pace(len(piece))
                await response.write(piece)
        finally:
            flowing -= 1

    return send


async def download(
    tmp_path: Path, data: bytes, pace: Callable[[int], Awaitable[None]]
) -> list[tuple[float, int]]:
    """Prefetch ``data`` over up to 16 connections from a server pacing every body with
    ``pace``; check the bytes and return (time, bodies in flight) at each body's start."""
    seen: list[tuple[float, int]] = []
    async with range_server(data, paced(data, pace, seen)) as url:
        config = fast_config(tmp_path, connections_per_file=16, chunk_size=1 << 20)
        result = await prefetch(url, config)
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    return seen


async def test_a_file_starts_with_four_connections_and_climbs_while_each_is_capped(
    tmp_path: Path,
) -> None:
    """2 MB/s per connection: every step brings more, so all 16 end up open."""

    async def per_connection_cap(n: int) -> None:
        await asyncio.sleep(n / 2e6)

    seen = await download(tmp_path, random_shard(48 << 20), per_connection_cap)
    start = seen[0][0]
    assert max(n for t, n in seen if t - start < 0.25) <= 4  # a quarter at first
    assert max(n for _, n in seen) == 16


async def test_a_file_does_not_climb_when_more_connections_bring_nothing(tmp_path: Path) -> None:
    """The link as a whole is the limit (16 MB/s shared): steps do not pay and are undone."""
    link = asyncio.Lock()

    async def shared_cap(n: int) -> None:
        async with link:
            await asyncio.sleep(n / 16e6)

    seen = await download(tmp_path, random_shard(32 << 20), shared_cap)
    assert max(n for _, n in seen) < 16


def test_connections_handed_on_are_taken_at_once_and_not_undone() -> None:
    rates = {4: 100e6, 6: 100e6, 9: 100e6, 10: 100e6, 15: 100e6}  # no step pays
    ramp = ConnectionRamp(16)
    assert [ramp.observe(100e6) for _ in range(3)] == [4, 4, 6]  # a step on trial
    assert ramp.grant(4) == 10  # on top of the trial: the host carried them a moment ago
    counts = climb(ramp, rates)
    assert min(counts) == 10 and counts[-1] in (10, 15)  # its own steps are undone, not it
    assert ConnectionRamp(16).grant(40) == 16


async def test_a_finished_file_hands_its_connections_to_one_still_climbing(
    tmp_path: Path,
) -> None:
    """Two files through one fetcher. The big one's link is shared (more connections bring
    nothing, so its own ramp stays at 4 or 6); once the small one ends, the big one takes
    the small one's connections at once instead of ending alone on a few."""
    import aiohttp

    from shardsync.cache import CacheStore
    from shardsync.fetch.fetcher import Fetcher
    from shardsync.fetch.request import BlobRequest
    from shardsync.store import AsyncStore

    link = asyncio.Lock()

    async def shared_cap(n: int) -> None:
        async with link:
            await asyncio.sleep(n / 24e6)

    async def free(n: int) -> None:
        await asyncio.sleep(0)

    big, small = os.urandom(40 << 20), os.urandom(8 << 20)
    seen_big: list[tuple[float, int]] = []
    seen_small: list[tuple[float, int]] = []
    store = AsyncStore(CacheStore(tmp_path / "cache"))
    config = fast_config(tmp_path, connections_per_file=16, chunk_size=1 << 20)
    async with (
        range_server(big, paced(big, shared_cap, seen_big)) as big_url,
        range_server(small, paced(small, free, seen_small)) as small_url,
        aiohttp.ClientSession() as session,
    ):
        fetcher = Fetcher(session, config.fetch)

        async def fetch(url: str, size: int, key: str) -> bytes:
            request = BlobRequest(url + "model.safetensors", {}, key, size=size)
            async with await store.slot(key) as slot:
                verified = await fetcher.fetch(request, slot)
                return verified.path.read_bytes()

        got_big, got_small = await asyncio.gather(
            fetch(big_url, len(big), "big"), fetch(small_url, len(small), "small")
        )
    assert got_big == big and got_small == small
    small_done = seen_small[-1][0]
    assert max(n for t, n in seen_big if t < small_done) <= 6
    assert max(n for t, n in seen_big if t > small_done) >= 8
