"""One protocol for a Range answer's body: ``Body``, and what it writes to (``Landing``).

A transfer (``fetch.transfer``) gets one ``Body`` per file and sends every range through it;
it never asks which it has. Two implement it: ``fetch.body_wire`` (the file's pump reads
answers framed by one ``Content-Length`` on our own sockets, off the event loop) and
``fetch.body_aiohttp`` (aiohttp reads proxied and chunked answers, and whole-file GETs).
Both check each answer with the same functions (``fetch.answers``), write its body at its
offset in the partial file, and tell the ``Landing`` of every byte: as it arrives
(``received``), when the resume record may claim it (``recorded``, on whichever thread wrote
it) and when the hasher may follow it (``on_disk``, on the loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from shardsync.errors import StalledError
from shardsync.fetch.answers import Bound
from shardsync.fetch.request import Throttle
from shardsync.records import FetchConfig

__all__ = [
    "Body",
    "FileWork",
    "Landing",
    "OpenBody",
    "Traffic",
    "Watchdog",
    "mark_retrieved",
]

_T = TypeVar("_T")


class Body(Protocol):
    """How one file's connections get a Range answer's body into the partial file."""

    async def get_range(
        self, url: str, headers: Mapping[str, str], start: int, end: int, *, whole: bool
    ) -> int:
        """GET ``url`` with ``headers`` (a Range for bytes ``[start, end)`` bound to the
        object, ``answers.range_headers``; none when ``whole``: the whole file in one GET),
        check the answer, write its body from ``start`` on and tell the ``Landing`` of each
        byte. Returns the bytes written: fewer when the body ends short (the caller asks for
        the rest). Raises what a refused answer means (``answers``: ``RetryLater``,
        ``Restart``, ``Relocate``, ``ProtocolError``...) or why the connection failed."""

    @property
    def bytes_read(self) -> int | None:
        """Body bytes read so far, all connections together, for the connection ramp to
        follow (``ramp.ConnectionRamp``); None: this path opens all connections at once."""

    def close(self) -> None:
        """Let go of what the file's bodies held (threads, sockets); called once none runs."""


@dataclass(frozen=True, slots=True)
class Landing:
    """One file's partial, where bodies land, and who hears of their bytes."""

    fd: int
    label: str  # the file, for messages
    bound: Bound  # size and ETag: what every answer is checked against
    work: FileWork  # the threads using ``fd``
    received: Callable[[int], None]  # on the loop: n body bytes arrived (progress, counters)
    recorded: Callable[[int, int], None]  # any thread: the resume record may claim the span
    on_disk: Callable[[int, int], None]  # on the loop, after ``recorded``: the hasher may read it
    pace: Throttle | None = None  # the request's own, after the fetcher's


OpenBody = Callable[[str, Landing, bool], Body]
"""Given a data URL, the file's ``Landing`` and whether it is fetched whole in one GET,
the body path for that file's connections."""


@dataclass(slots=True)
class Traffic:
    """Counters the fetcher reports (``FetchStatistics``), fed by whoever moves the bytes."""

    bytes: int = 0  # body bytes received
    active: int = 0  # requests in flight


class FileWork:
    """Blocking work on one file's descriptor, tracked so the descriptor outlives it.

    A cancelled coroutine does not stop its thread; closing the descriptor under a running
    ``pwrite`` could write into whatever file reuses the number. ``drain`` waits for it all.
    """

    def __init__(self) -> None:
        self._in_flight: set[asyncio.Future[Any]] = set()

    def start(
        self, fn: Callable[..., _T], *args: object, executor: Executor | None = None
    ) -> asyncio.Future[_T]:
        """Start ``fn(*args)`` in a thread. Await the result through ``asyncio.shield`` so a
        cancellation never marks it done early."""
        future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        self._add(future)
        return future

    async def run(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.shield(self.start(fn, *args))

    def track(self, body: concurrent.futures.Future[int]) -> asyncio.Future[int]:
        """Work another thread does (the pump's reading) as a loop future ``drain`` waits
        for: the file must stay open while it writes."""
        future = asyncio.wrap_future(body)
        self._add(future)
        return future

    async def drain(self) -> None:
        """Wait for every thread still using the descriptor (even after a cancellation)."""
        while self._in_flight:
            await asyncio.wait(set(self._in_flight))

    def _add(self, future: asyncio.Future[Any]) -> None:
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)
        future.add_done_callback(mark_retrieved)


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Its awaiter may be gone (cancelled by a sibling's error, e.g. several writes hitting
    ENOSPC at once): the error is reported once, by the first, not logged by asyncio again."""
    if not future.cancelled():
        future.exception()


class Watchdog:
    """Gives up on a connection whose rate over ``throughput_window`` is under
    ``min_throughput``: a server trickling bytes never trips the read timeout."""

    def __init__(self, clock: Callable[[], float], config: FetchConfig) -> None:
        self._clock = clock
        self._config = config
        self._start = clock()
        self._bytes = 0

    def count(self, n: int) -> None:
        self._bytes += n
        now = self._clock()
        if now - self._start < self._config.throughput_window:
            return
        rate = self._bytes / (now - self._start)
        if rate < self._config.min_throughput:
            raise StalledError(
                f"{rate:.0f} B/s is under the {self._config.min_throughput} B/s minimum"
            )
        self._start, self._bytes = now, 0
