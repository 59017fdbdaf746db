"""Fetcher details that the end-to-end tests do not isolate."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from helpers import fast_config, handler_at, range_server

from shardsync.cache import CacheStore
from shardsync.errors import ManifestError, ProtocolError
from shardsync.fetch.answers import follow as _follow
from shardsync.fetch.fetcher import Fetcher
from shardsync.fetch.request import BlobRequest, joined
from shardsync.prefetch import prefetch
from shardsync.slot import Slot
from shardsync.testing import Bandwidth, FakeHub, fakehub, serve_in_thread


@pytest.mark.parametrize(
    ("url", "location", "target", "keeps_token"),
    [
        ("https://hub.example/a", "/b", "https://hub.example/b", True),
        ("https://hub.example/a", "https://hub.example:443/b", "https://hub.example:443/b", True),
        ("https://hub.example/a", "https://cdn.example/b", "https://cdn.example/b", False),
        (
            "https://hub.example/a",
            "https://hub.example:8443/b",
            "https://hub.example:8443/b",
            False,
        ),
        ("http://127.0.0.1:1/a", "http://127.0.0.2:1/b", "http://127.0.0.2:1/b", False),
        ("http://hub.example/a", "https://hub.example/b", "https://hub.example/b", False),
    ],
)
def test_redirects_keep_credentials_home(
    url: str, location: str, target: str, keeps_token: bool
) -> None:
    headers = {"Authorization": "Bearer t", "Cookie": "c", "Range": "bytes=0-1"}
    new_url, new_headers = _follow(url, headers, location)
    assert new_url == target
    assert ("Authorization" in new_headers) is keeps_token
    assert ("Cookie" in new_headers) is keeps_token
    assert new_headers["Range"] == "bytes=0-1"


@pytest.mark.parametrize(
    ("url", "location", "message"),
    [
        ("https://hub.example/a", "http://hub.example/b", "https -> http"),
        ("https://hub.example/a", "file:///etc/passwd", "'file'"),
        ("https://hub.example/a", None, "without Location"),
        # credentials of its own, same origin: aiohttp raised a bare ValueError beside ours
        ("https://hub.example/a", "https://u:p@hub.example/b", "user:password@"),
    ],
)
def test_dangerous_redirects_are_refused(url: str, location: str | None, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        _follow(url, {}, location)


async def test_empty_file(tmp_path: Path) -> None:
    async with FakeHub() as hub:
        files = {"model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "empty.txt": b""}
        hub.add_repo("acme/empty", files)
        result = await prefetch("acme/empty", fast_config(tmp_path, hub.endpoint))
    assert (result.snapshot_path / "empty.txt").read_bytes() == b""
    assert (result.snapshot_path / "model.safetensors").read_bytes() == files["model.safetensors"]


@pytest.mark.parametrize(
    ("size", "connections", "ranges"),
    [
        (8 << 20, 4, 4),  # 8 MiB over 4 connections: 2 MiB each, not one 16 MiB chunk
        (3 << 20, 8, 3),  # never a Range under 1 MiB
        # larger than 2 x chunk_size: 16 MiB chunks, the last round (one each) in quarters
        (64 << 20, 2, 2 + 2 * 4),
        # 12 MiB: 3 ranges each, not 16 MiB with one connection doing 3 of 5; last round cut
        (72 << 20, 2, 4 + 2 * 4),
    ],
)
async def test_smaller_files_are_split_across_connections(
    tmp_path: Path, size: int, connections: int, ranges: int
) -> None:
    data = b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + bytes(size - 10)
    async with FakeHub() as hub:
        hub.add_repo("acme/split", {"model.safetensors": data})
        config = fast_config(
            tmp_path, hub.endpoint, chunk_size=16 << 20, connections_per_file=connections
        )
        result = await prefetch("acme/split", config)
        asked = [r.range for r in hub.log if r.server == "cdn" and r.range]
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    assert len(asked) == ranges


@pytest.mark.parametrize("unsafe", [False, True], ids=["names", "an-unsafe-name"])
async def test_a_large_repo_is_listed_through_the_paginated_tree(
    tmp_path: Path, unsafe: bool
) -> None:
    """The Hub may cut ``siblings`` short for a large repo: the tree API lists it all. A name
    left out as unsafe (a ``#``) still counts among the 1000 the Hub answered: taken for a
    whole list of 999, it hid the weights past the cut."""
    files = {"model.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}"}
    files |= {f"data/{i:04d}.txt": f"row {i}\n".encode() for i in range(1200)}
    odd = {"data/0000#.txt": b"left out\n"} if unsafe else {}
    async with FakeHub(siblings_cap=1000, tree_page_size=250) as hub:
        hub.add_repo("acme/big", files | odd)
        result = await prefetch("acme/big", fast_config(tmp_path, hub.endpoint), include=["data/*"])
        pages = [r for r in hub.log if "/tree/" in r.path]
    assert len(pages) == 5  # 1201 (or 1202) files and one folder, 250 entries a page
    for name, data in files.items():
        assert (result.snapshot_path / name).read_bytes() == data


async def test_a_tree_listing_that_goes_round_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A next page that links back to a page already read: each round added its entries
    again, memory growing for 10 000 pages before any error."""
    first = fakehub.encode_cursor(0)
    monkeypatch.setattr(fakehub, "encode_cursor", lambda _offset: first)
    files = {f"data/{i:04d}.txt": b"row\n" for i in range(1200)}
    async with FakeHub(siblings_cap=1000, tree_page_size=250) as hub:
        hub.add_repo("acme/round", files)
        with pytest.raises(ManifestError):
            await prefetch("acme/round", fast_config(tmp_path, hub.endpoint))
        pages = [r for r in hub.log if "/tree/" in r.path]
    assert len(pages) == 2  # the first page, and the one it linked to, which links to itself


async def test_a_next_page_on_another_origin_is_refused(tmp_path: Path) -> None:
    async def page(request: web.Request) -> web.Response:
        return web.json_response([], headers={"Link": '<http://127.0.0.2:9/steal>; rel="next"'})

    app = web.Application()
    app.router.add_get("/list", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/list"
        async with aiohttp.ClientSession() as session:
            fetcher = Fetcher(session, fast_config(tmp_path).fetch)
            with pytest.raises(ProtocolError, match="next page on another origin"):
                await fetcher.get_page(url, {"Authorization": "Bearer t"}, max_size=1000, label="x")
    finally:
        await runner.cleanup()


def _claimed(partial: Path) -> list[list[int]]:
    """The ranges the one resume record in ``partial`` claims (none before it exists)."""
    for _ in range(100):  # read while it is rewritten: a torn read is read again
        try:
            (record,) = partial.glob("*.json")
            return list(json.loads(record.read_bytes())["done"])
        except ValueError:  # no record yet, or a torn one
            time.sleep(0.005)
    raise AssertionError("no readable resume record")


async def test_the_resume_record_follows_the_bytes_while_the_event_loop_is_busy(
    tmp_path: Path,
) -> None:
    """A ``kill -9`` loses what the resume record does not claim. Bytes land on the pump's
    thread; a record saved from the event loop fell behind whenever the loop was busy (by
    7-25 MB at the kills of ``bench/kill.py``). Here the loop is blocked mid-download: the
    record keeps claiming what lands, and what it claims is the origin's bytes."""
    data = b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + os.urandom((64 << 20) - 10)
    mib = 1 << 20
    partial = tmp_path / "c" / "partial"
    with serve_in_thread(FakeHub()) as hub:
        hub.add_repo("acme/rec", {"model.safetensors": data})
        hub.faults.add(Bandwidth(4_000_000))  # 4 connections: about 4 s in all
        config = fast_config(
            tmp_path / "c", hub.endpoint, chunk_size=8 * mib, read_size=mib, sidecar_bytes=mib
        )
        task = asyncio.create_task(prefetch("acme/rec", config))
        while not list(partial.glob("*.json")) or not _claimed(partial):
            assert not task.done()
            await asyncio.sleep(0.01)
        before = sum(end - start for start, end in _claimed(partial))
        time.sleep(0.8)  # noqa: ASYNC251 - the point: the loop stalls, only threads run
        claimed = _claimed(partial)
        (part,) = partial.glob("*.part")
        on_disk = part.read_bytes()
        result = await task
    assert sum(end - start for start, end in claimed) - before >= 4 * mib
    for start, end in claimed:
        assert on_disk[start:end] == data[start:end]
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data


def test_joined_throttles_each_hear_every_read_and_the_longer_pause_wins() -> None:
    """The daemon's bandwidth cap beside a claim holder's lead: both are charged every read
    (the cap must count bytes the lead holds back too), and the reader waits for the longer."""
    heard: dict[str, list[int]] = {"cap": [], "lead": []}

    def cap(n: int) -> float:
        heard["cap"].append(n)
        return 0.5

    def lead(n: int) -> float:
        heard["lead"].append(n)
        return 0.02

    both = joined(cap, lead)
    assert both is not None and both(100) == 0.5 and both(0) == 0.5
    assert heard == {"cap": [100, 0], "lead": [100, 0]}
    assert joined(cap, None) is cap and joined(None, lead) is lead and joined(None, None) is None


@pytest.mark.parametrize("chunked", [False, True], ids=["pump", "aiohttp"])
async def test_a_throttle_hold_longer_than_the_timeouts_times_nothing_out(
    tmp_path: Path, chunked: bool
) -> None:
    """A throttle (a pace catching up) holds the file's reads for 2 s, longer than the read
    timeout and the watchdog's window: no server was silent or slow, so no connection is
    dropped for it, on the pump's body path and on aiohttp's (chunked answers, proxies)."""
    data = os.urandom(8 << 20)
    held_until: list[float] = []

    def hold(n: int) -> float:
        if not held_until and n:
            held_until.append(time.monotonic() + 2.0)
        return 0.25 if time.monotonic() < held_until[0] else 0.0

    async def send(response: web.StreamResponse, first: int, last: int) -> None:
        for pos in range(first, last + 1, 64 << 10):
            await response.write(data[pos : min(pos + (64 << 10), last + 1)])
            await asyncio.sleep(0.01)  # about 6 MB/s per connection

    settings = fast_config(
        tmp_path,
        chunk_size=2 << 20,
        read_timeout=1.0,
        min_throughput=256 << 10,
        throughput_window=1.0,
    ).fetch
    server = range_server(data, send, chunked=chunked)
    async with server as base, aiohttp.ClientSession() as session:
        fetcher = Fetcher(session, settings, throttle=hold)
        request = BlobRequest(
            url=base + "model.safetensors",
            headers={},
            label="f",
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )
        async with Slot(CacheStore(tmp_path), "k" * 64) as slot:
            verified = await fetcher.fetch(request, slot)
    assert held_until and verified.verified == "sha256" and verified.downloaded == len(data)
    assert fetcher.statistics().retries == {}


async def _head_without_length(request: web.Request) -> web.StreamResponse:
    """A ``HEAD`` answered chunked: no ``Content-Length``, so the fetcher probes the size."""
    head = web.StreamResponse(headers={"ETag": '"v1"'})
    head.enable_chunked_encoding()
    await head.prepare(request)
    return head


async def test_a_probed_size_past_any_file_is_the_origins_lie(tmp_path: Path) -> None:
    """A one-byte GET whose ``Content-Range`` says 10**19 - 1 bytes in all was Python's
    ``OverflowError`` from ``ftruncate``: a traceback where the origin lied."""

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "HEAD":
            return await _head_without_length(request)
        headers = {"ETag": '"v1"', "Content-Range": f"bytes 0-0/{10**19 - 1}"}
        return web.Response(status=206, body=b"x", headers=headers)

    async with handler_at(handle) as base, aiohttp.ClientSession() as session:
        fetcher = Fetcher(session, fast_config(tmp_path).fetch)
        request = BlobRequest(url=base + "model.safetensors", headers={}, label="f")
        async with Slot(CacheStore(tmp_path), "k" * 64) as slot:
            with pytest.raises(ProtocolError):
                await fetcher.fetch(request, slot)


async def test_the_size_probe_is_retried_as_every_request_of_a_file(tmp_path: Path) -> None:
    """A HEAD without a length sends a one-byte GET to learn it; a 503 to that (with
    ``Retry-After: 0``) is asked again, as any request of a file is, not the file's end."""
    data = os.urandom(1 << 20)
    refused: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method == "HEAD":
            return await _head_without_length(request)
        ranged = request.headers["Range"]
        if ranged == "bytes=0-0" and not refused:
            refused.append(ranged)
            return web.Response(status=503, headers={"Retry-After": "0"})
        first, _, last = ranged.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last), len(data) - 1)
        headers = {"ETag": '"v1"', "Content-Range": f"bytes {start}-{end}/{len(data)}"}
        return web.Response(status=206, body=data[start : end + 1], headers=headers)

    async with handler_at(handle) as base, aiohttp.ClientSession() as session:
        fetcher = Fetcher(session, fast_config(tmp_path).fetch)
        request = BlobRequest(
            url=base + "model.safetensors",
            headers={},
            label="f",
            size=None,
            sha256=hashlib.sha256(data).hexdigest(),
        )
        async with Slot(CacheStore(tmp_path), "k" * 64) as slot:
            verified = await fetcher.fetch(request, slot)
    assert refused == ["bytes=0-0"]
    assert verified.verified == "sha256" and verified.downloaded == len(data)
