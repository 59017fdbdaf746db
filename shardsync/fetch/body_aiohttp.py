"""The ``Body`` that aiohttp reads: answers through a proxy, chunked or unframed ones, and
whole-file GETs.

Each request goes through the fetcher's session (``send``: redirects by hand, the proxy,
the timeouts); each received piece is written as it is (``pwritev``, no copies) in a worker
thread while the next batch is read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol

import aiohttp

from shardsync.errors import disk_error
from shardsync.fetch.answers import (
    ERROR_BODY,
    Restart,
    check_range_answer,
    check_whole_answer,
)
from shardsync.fetch.body import Landing, Watchdog
from shardsync.fetch.disk import write_all
from shardsync.fetch.request import Throttle
from shardsync.records import FetchConfig

__all__ = ["AiohttpBody", "Refuse", "Send"]

Send = Callable[
    [str, str, Mapping[str, str]], contextlib.AbstractAsyncContextManager[aiohttp.ClientResponse]
]
"""``(method, url, headers)``: the answer to a request sent through the fetcher's session."""


class Refuse(Protocol):
    """Raises what a non-success answer means (``answers.status_error``, and a proxy's 407)."""

    async def __call__(
        self, resp: aiohttp.ClientResponse, label: str, *, relocatable: bool = ...
    ) -> None: ...


class AiohttpBody:
    """One file's bodies read by aiohttp on the event loop: all connections at once."""

    def __init__(
        self,
        landing: Landing,
        *,
        send: Send,
        refuse: Refuse,
        config: FetchConfig,
        clock: Callable[[], float],
        throttle: Throttle | None,
    ) -> None:
        self._landing = landing
        self._send = send
        self._refuse = refuse
        self._config = config
        self._clock = clock
        self._throttle = throttle

    @property
    def bytes_read(self) -> int | None:
        return None  # no ramp: the event loop reads every connection as it comes

    def close(self) -> None:
        pass  # the session's connections are the fetcher's

    async def get_range(
        self, url: str, headers: Mapping[str, str], start: int, end: int, *, whole: bool
    ) -> int:
        landing = self._landing
        state, label = landing.bound, landing.label
        async with self._send("GET", url, headers) as resp:
            if resp.status == 200 and whole:
                check_whole_answer(resp.headers.get, label, state, resp.content_length)
            elif resp.status in (200, 206, 416):
                # a chunked body has no length to hold it to the Content-Range's end
                end = check_range_answer(resp.status, resp.headers.get, label, state, start, end)
            else:
                await self._refuse(resp, label, relocatable=True)
            # a whole 200 without a length must end at the size: a longer one is another object
            whole = whole and resp.status == 200
            return await self._stream_body(resp, start, end, whole=whole)

    async def _stream_body(
        self, resp: aiohttp.ClientResponse, start: int, end: int, *, whole: bool = False
    ) -> int:
        """Read ``[start, end)`` from the body; returns the bytes written (may be short).

        Received pieces are written as they are (``pwritev``, no copies) while the next
        batch is read: at most one write per connection is in flight, and a range counts as
        done only once its write returned.

        A body without ``Content-Length`` (chunked, or ended by the close) is the server's
        own only up to its last intact chunk: a chunk whose size lies hands on the next
        chunk's header as data before the parser notices. So its bytes count as done (for
        the hasher and the resume record) only up to a chunk's end or the body's clean end;
        the rest is written but asked for again.

        A ``whole`` body that runs past ``end`` is not the object whose size was asked for
        (it changed, or grew): ``Restart``, which drops what was written.
        """
        cfg = self._config
        landing = self._landing
        framed = resp.content_length is not None  # aiohttp's parser holds it to that length
        pieces: list[bytes] = []
        pending = 0
        queued = start  # being written before ``queued``
        trusted = claimed = written = start  # framing checked; counted as done; on disk
        writing: asyncio.Future[None] | None = None
        held = 0.0  # paused by the throttle: neither silence nor under ``min_throughput``
        watchdog = Watchdog(lambda: self._clock() - held, cfg)

        async def settle() -> None:
            nonlocal writing, written
            if writing is None:
                return
            future, writing = writing, None
            try:
                await asyncio.shield(future)
            except OSError as exc:
                raise disk_error(exc, "write the partial file") from exc
            written = claimed

        def landed(first: int, stop: int) -> Callable[[asyncio.Future[None]], None]:
            """Count a batch as done the moment its write returns, not when the next batch
            is ready: the resume record may claim it from then on."""

            def mark(future: asyncio.Future[None]) -> None:
                if future.cancelled() or future.exception() is not None or first == stop:
                    return
                landing.on_disk(first, stop)

            return mark

        async def flush() -> None:
            nonlocal pieces, pending, queued, writing, claimed
            await settle()
            if not pieces and trusted == claimed:
                return
            batch, pieces, pending = pieces, [], 0
            size = sum(len(p) for p in batch)
            writing = landing.work.start(_write_landed, landing, batch, queued, (claimed, trusted))
            writing.add_done_callback(landed(claimed, trusted))
            queued += size
            claimed = trusted

        try:
            while queued + pending < end:
                want = end - queued - pending
                async with asyncio.timeout(cfg.read_timeout):  # see ``_chunk_ends``
                    if framed:
                        piece = await resp.content.read(min(cfg.read_size, want))
                        chunk_ended = False
                    else:
                        piece, chunk_ended = await resp.content.readchunk()
                        if whole and (len(piece) > want or queued + pending + len(piece) == end):
                            await _whole_ends(resp, len(piece) - want, cfg.read_timeout)
                piece = piece[:want]
                if not piece:
                    trusted = queued + pending  # a chunk's end, or the body's clean end
                    if chunk_ended:
                        continue
                    break
                if self._throttle is not None:
                    pause = self._throttle(len(piece))
                    while pause > 0:
                        paused = self._clock()
                        await asyncio.sleep(pause)
                        held += self._clock() - paused
                        pause = self._throttle(0)
                pieces.append(piece)
                n = len(piece)
                pending += n
                if framed or chunk_ended:
                    trusted = queued + pending
                landing.received(n)
                if pending >= cfg.write_size:
                    await flush()
                watchdog.count(n)
            if trusted < queued + pending and await _chunk_ends(resp, ERROR_BODY, cfg.read_timeout):
                trusted = queued + pending
        finally:
            await flush()
            await settle()
        return written - start


async def _whole_ends(resp: aiohttp.ClientResponse, over: int, read_timeout: float) -> None:
    """Raise ``Restart`` unless a whole body ends with the piece just read (``over``: its
    bytes past the size): the first ``size`` bytes of a longer body are another object's."""
    if over == 0:
        async with asyncio.timeout(read_timeout):
            over = len(await resp.content.read(1))
    if over > 0:
        raise Restart("the whole body is longer than the file", etag=None, single_stream=True)


async def _chunk_ends(resp: aiohttp.ClientResponse, limit: int, read_timeout: float) -> bool:
    """Whether a chunk or the body ends within the next ``limit`` bytes (read and dropped):
    the parser's proof that the bytes before were the body's, not a lying chunk size's.

    Every body read on the aiohttp path has a timeout of our own: when aiohttp's parser
    fails on a chunk in mid-body (aiohttp 3.14), the reader is never woken, by the error or
    by the session's read timeout, and would wait for ever."""
    left = limit
    while True:
        async with asyncio.timeout(read_timeout):
            piece, ended = await resp.content.readchunk()
        if ended or not piece:
            return True
        left -= len(piece)
        if left < 0:
            return False


def _write_landed(landing: Landing, batch: list[bytes], first: int, claim: tuple[int, int]) -> None:
    """Write ``batch`` at ``first`` in a worker thread and tell the resume record at once
    that bytes ``claim`` (written by now, by this batch or the ones before it) are done."""
    write_all(landing.fd, batch, first)
    if claim[1] > claim[0]:
        landing.recorded(*claim)
