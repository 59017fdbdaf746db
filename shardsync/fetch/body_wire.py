"""The ``Body`` read off the event loop: our own sockets (``fetch.wire``) and the file's pump
(``fetch.pump``), for direct http(s) answers framed by one ``Content-Length``.

A worker thread sends each request, reads the head and checks it as the aiohttp path does
(``answers``), then hands an answer that passes to the pump itself: a body never waits in
socket buffers for the event loop's turn (a ``kill -9`` would lose what waits there). An
answer only aiohttp reads (a redirect, a body without a length) is asked for again on the
aiohttp path, and after a body without a length so is every later range of the file; every
other answer means what it means there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from ssl import SSLContext
from urllib.parse import urlsplit

from shardsync.fetch.answers import (
    ERROR_BODY,
    REDIRECTS,
    check_range_answer,
    status_error,
)
from shardsync.fetch.body import Body, FileWork, Landing, Traffic, Watchdog
from shardsync.fetch.pump import Pump
from shardsync.fetch.request import Throttle
from shardsync.fetch.wire import Opening, RangeReader, Stream
from shardsync.network import NetworkConfig
from shardsync.records import FetchConfig

__all__ = ["WireBody", "serves"]

Headers = Callable[[str, Mapping[str, str]], dict[str, str]]
"""A request's headers as sent to ``url``: ours, the configured ones, then its own."""


def serves(url: str, network: NetworkConfig) -> bool:
    """Bodies go through worker threads on direct http(s) connections; through a proxy
    they take the aiohttp path, which speaks to proxies."""
    return urlsplit(url).scheme in ("http", "https") and network.proxy_for(url) is None


@dataclass(frozen=True, slots=True)
class _Begun:
    """A request sent on the wire and its head read; ``body``: the pump reads it."""

    stream: Stream
    body: concurrent.futures.Future[int] | None


class WireBody:
    """One file's bodies: its connections, the threads that open them (connect, send, read
    the head: blocking) and the pump that reads every body. What only aiohttp reads goes to
    ``fallback``."""

    def __init__(
        self,
        landing: Landing,
        fallback: Body,
        tls: SSLContext | None,
        *,
        config: FetchConfig,
        clock: Callable[[], float],
        throttle: Throttle | None,
        headers: Headers,
        traffic: Traffic,
    ) -> None:
        self._landing = landing
        self._fallback = fallback
        self._config = config
        self._clock = clock
        self._headers = headers
        self._traffic = traffic
        self._unframed = False  # a body without a length came: aiohttp reads them all
        self._reader = RangeReader(
            tls, connect_timeout=config.connect_timeout, read_timeout=config.read_timeout
        )
        self._threads = ThreadPoolExecutor(
            config.connections_per_file, thread_name_prefix="shardsync-open"
        )
        self._pump = Pump(
            landing.fd,
            read_size=config.read_size,
            report_size=config.write_size,
            read_timeout=config.read_timeout,
            clock=clock,
            throttle=throttle,
        )

    @property
    def bytes_read(self) -> int | None:
        return self._pump.received

    def close(self) -> None:
        self._pump.close()
        self._threads.shutdown(wait=False)
        self._reader.close()

    async def get_range(
        self, url: str, headers: Mapping[str, str], start: int, end: int, *, whole: bool
    ) -> int:
        if not whole and not self._unframed:
            received = await self._get_range(url, headers, start, end)
            if received is not None:
                return received
        return await self._fallback.get_range(url, headers, start, end, whole=whole)

    async def _get_range(
        self, url: str, headers: Mapping[str, str], start: int, end: int
    ) -> int | None:
        """The range with its body read by the pump and written to the file; None: an
        answer only the aiohttp path reads. Bytes count as on disk the moment their
        ``pwrite`` returns (they are in the page cache), reported every ``write_size``."""
        landing, pump, work = self._landing, self._pump, self._landing.work
        state, label = landing.bound, landing.label
        loop = asyncio.get_running_loop()

        def landed(first: int, stop: int) -> None:
            landing.received(stop - first)
            landing.on_disk(first, stop)

        def report(first: int, stop: int) -> None:
            landing.recorded(first, stop)
            loop.call_soon_threadsafe(landed, first, stop)

        # the throttle's holds are no slowness of the server's: kept out of its window
        watchdog = Watchdog(lambda: self._clock() - pump.held, self._config)
        request = Opening()

        def begin() -> _Begun:
            stream = self._reader.open(url, self._headers(url, headers), request)
            head = stream.head
            if head.status not in (200, 206, 416) or not stream.framed:
                return _Begun(stream, None)
            try:
                check_range_answer(head.status, head.get, label, state, start, end)
            except BaseException:
                stream.close()
                raise
            return _Begun(stream, pump.receive(stream, start, end, report, watchdog.count))

        self._traffic.active += 1
        try:
            opening = work.start(begin, executor=self._threads)
            try:
                begun = await asyncio.shield(opening)
            except asyncio.CancelledError:
                request.abort()  # a head still coming: drain need not wait for its timeout
                opening.add_done_callback(partial(_abandon, work, pump))
                raise
            stream = begun.stream
            try:
                if begun.body is not None:
                    return await _await_body(work, pump, stream, begun.body)
                head = stream.head
                if head.status in (200, 206, 416):
                    self._unframed = True  # a body without a length: the aiohttp path reads
                    return None  # it, and the file's later ones (no request twice)
                if head.status in REDIRECTS:
                    return None
                reading = work.start(stream.read_small, ERROR_BODY, executor=self._threads)
                body = await asyncio.shield(reading)
                raise status_error(head.status, head.get, body, label, relocatable=True)
            finally:
                stream.close()
        finally:
            self._traffic.active -= 1


async def _await_body(
    work: FileWork, pump: Pump, stream: Stream, body: concurrent.futures.Future[int]
) -> int:
    future = work.track(body)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        pump.abort(stream)
        raise


def _abandon(work: FileWork, pump: Pump, opening: asyncio.Future[_Begun]) -> None:
    """A request whose caller was cancelled while it started: stop its body, if the pump
    took one, and let the connection go."""
    if opening.cancelled() or opening.exception() is not None:
        return
    begun = opening.result()
    if begun.body is not None:
        work.track(begun.body)
        pump.abort(begun.stream)
    begun.stream.close()
