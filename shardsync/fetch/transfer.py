"""One attempt at one file: its connections, the hash that follows their bodies, and the
resume record that follows what is on disk.

Per file, several Range requests pull chunks in ascending order from a shared queue; their
bodies land at their offsets in the partial file through one ``Body`` (``fetch.body``),
which the transfer never asks the kind of. A hasher follows the contiguous prefix on disk,
reading it through a mapping, so sha256 (and xxh3-128 for fast re-checks) is ready moments
after the last byte without a second pass over the network. What it needs of the fetcher
comes in ``Services``, and nothing else of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from shardsync.checksums import StoreChecksum
from shardsync.digest import Digest, MappedFile
from shardsync.errors import ProtocolError, ShardsyncError
from shardsync.fetch.answers import (
    TRANSIENT,
    Relocate,
    Restart,
    RetryLater,
    opaque_tag,
    range_headers,
)
from shardsync.fetch.body import Body, FileWork, Landing, OpenBody, Traffic
from shardsync.fetch.disk import start_writeback
from shardsync.fetch.request import BlobRequest, Located, ProgressFn, Turn
from shardsync.manifest import MAX_FILE_SIZE
from shardsync.ramp import ConnectionRamp
from shardsync.ranges import RangeSet, is_strong_etag, split_ranges, split_tail
from shardsync.records import FetchConfig, Verification, VerifiedFile
from shardsync.retry import Backoff
from shardsync.slot import RecordKeeper, Resumable, Slot
from shardsync.tasks import to_the_end

__all__ = ["Climbers", "FileDownload", "FileState", "Services", "Tally"]

_MIN_SPLIT = 1 << 20  # the smallest Range worth a connection of its own
_TAIL_PARTS = 4  # the last round of ranges is cut in this many (``split_tail``)
_RAMP_EVERY = 0.1  # seconds between the connection ramp's looks at a file's rate
_WRITEBACK_EVERY = 8 << 20  # hashed bytes sent to the disk at once


@dataclass(slots=True)
class Tally:
    """One ``fetch`` call's counts across its attempts (relocations, restarts)."""

    downloaded: int = 0
    resumed: int | None = None  # from an earlier run: set by the first attempt


@dataclass(slots=True, eq=False)  # one per transfer, compared and hashed by identity
class FileState:
    """Mutable per-file transfer state shared by its connections."""

    fd: int
    size: int
    etag: str | None
    done: RangeSet
    single_stream: bool
    tag: str | None = None  # the entity tag first seen, weak too (``answers.Bound``)
    downloaded: int = 0
    closing: bool = False  # the connections are done: the record keeper stops
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # ``closing`` became true
    work: FileWork = field(default_factory=FileWork)  # threads using ``fd``
    etag_lock: threading.Lock = field(default_factory=threading.Lock)
    pages: MappedFile | None = None  # what the hasher reads the file through
    body: Body | None = None  # how the connections get their bodies into ``fd``
    connections: int = 0  # running
    wanted: int = 0  # what the ramp asks for: a connection beyond it takes no next range
    handed: int = 0  # connections a finished file handed on to this one, not yet taken
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # every range is taken
    at_tail: Callable[[], None] = lambda: None  # a connection found no range left (``Turn``)
    written_back: int = 0  # bytes [0, this) have been sent to the disk (``start_writeback``)
    keeper: RecordKeeper = field(init=False)  # the resume record, told first (on the thread)

    def on_disk(self, first: int, stop: int) -> None:
        """Bytes ``[first, stop)`` are in the file (``keeper`` knows already): the hasher
        may follow them."""
        self.done.add(first, stop)
        self.progressed.set()


class Climbers:
    """One fetcher's transfers whose connection ramp still has ranges to give."""

    def __init__(self) -> None:
        self.climbing: set[FileState] = set()

    def hand_on(self, count: int) -> None:
        """A transfer ended holding ``count`` connections: the host was carrying them a moment
        ago, so the transfers still climbing take them at once, shared out, instead of each
        climbing step by step while the last file ends alone on a few connections."""
        takers = list(self.climbing)
        for state in takers:
            state.handed += -(-count // len(takers))


@dataclass(frozen=True, slots=True)
class Services:
    """What a file's transfer gets from the ``Fetcher`` that runs it, and nothing more."""

    config: FetchConfig
    clock: Callable[[], float]
    traffic: Traffic  # the fetcher's counters: body bytes received here
    climbers: Climbers  # the fetcher's transfers still climbing: connections handed on
    probe_size: Callable[[Located, str], Awaitable[int]]  # for origins whose HEAD omits it
    open_body: OpenBody  # the file's body path (the pump, or aiohttp)
    # sleeps before a range's next try (counting the retry), or raises the error to give up on
    backoff_or_raise: Callable[[BaseException, str, Backoff, float | None], Awaitable[None]]


class FileDownload:
    """One attempt at one file. ``Fetcher.fetch`` makes one per attempt (a relocation or a
    restart starts another) and owns the retries around it."""

    def __init__(self, services: Services) -> None:
        self._services = services
        self.config = services.config
        self._clock = services.clock

    async def run(
        self,
        request: BlobRequest,
        located: Located,
        slot: Slot,
        on_progress: ProgressFn,
        single_stream: bool,
        tally: Tally,
        turn: Turn | None = None,
    ) -> VerifiedFile | None:
        size = located.size
        if size is None:
            size = await self._services.probe_size(located, request.label)
        if request.size is not None and size != request.size:
            raise ProtocolError(
                f"{request.label}: origin reports {size} bytes, manifest says {request.size}"
            )
        if size > MAX_FILE_SIZE:  # a lie: the cache cannot be blamed for not holding it
            raise ProtocolError(f"{request.label}: origin reports {size} bytes")
        etag = located.etag if is_strong_etag(located.etag) else None
        opened = slot.open(Resumable(request.url, etag, size, request.sha256))
        fd, done, record = opened.fd, opened.done, opened.record
        resumed = done.total()
        if tally.resumed is None:
            tally.resumed = resumed
        state = FileState(
            fd=fd,
            size=size,
            etag=etag,
            done=done,
            single_stream=single_stream,
            tag=opaque_tag(located.etag),
        )
        state.keeper = RecordKeeper(
            record, done, self.config.sidecar_bytes, partial(_resumable, request, state)
        )
        on_progress(resumed)
        verified: Verification | None = None
        state.pages = MappedFile(fd, size)
        try:
            try:
                # one whole-file GET (a direct request, a restart in one stream) takes the
                # aiohttp path: no worker threads to start for it
                whole_only = single_stream and resumed == 0
                landing = self._landing(request, state, on_progress)
                state.body = self._services.open_body(located.url, landing, whole_only)
                # the store's own checksum where the origin names no hash: of exactly the
                # object whose ETag each Range request is bound to
                store = located.checksum if request.sha256 is None else None
                if request.git_blob_id is not None or (store and not store.checkable):
                    store = None
                async with asyncio.TaskGroup() as tg:
                    hasher = tg.create_task(self._hash(state, request, store))
                    if record is not None:
                        tg.create_task(self._keep_record(state))
                    try:
                        await self._run_connections(request, located, state, turn)
                    finally:
                        state.closing = True  # the keeper returns (no cancel to lose)
                        state.closed.set()
                hashes = hasher.result()
                digest, xxh, git_sha1 = hashes.sha256, hashes.xxh3_128, hashes.git_sha1
                store_ok = hashes.store is not None and hashes.store.matches()
            except BaseExceptionGroup as group:
                _raise_first(group)
                raise  # unreachable: _raise_first always raises
            finally:

                async def wind_up() -> None:
                    await state.work.drain()  # no thread may still use ``fd`` when it closes
                    _close_transfer(state)
                    tally.downloaded += state.downloaded
                    try:
                        await state.work.run(state.keeper.save)
                    finally:
                        os.close(fd)
                        if record is not None:
                            record.close()

                await to_the_end(wind_up())
            if request.sha256 is not None:
                verified = "sha256" if digest == request.sha256 else None
            elif request.git_blob_id is not None:
                verified = "git-sha1" if git_sha1 == request.git_blob_id else None
            elif store is not None:
                verified = store.algorithm if store_ok else None
            else:
                verified = "tofu"
        finally:
            if verified is None:
                slot.suspend()
        if verified is None:
            return None
        return VerifiedFile(
            path=slot.verified(),
            size=size,
            sha256=digest,
            xxh3_128=xxh,
            etag=state.etag,
            verified=verified,
            downloaded=tally.downloaded,  # every attempt's bytes: each arrived once
            resumed=tally.resumed or 0,
        )

    def _landing(self, request: BlobRequest, state: FileState, on_progress: ProgressFn) -> Landing:
        traffic = self._services.traffic

        def received(n: int) -> None:
            state.downloaded += n
            traffic.bytes += n
            on_progress(n)

        return Landing(
            fd=state.fd,
            label=request.label,
            bound=state,
            work=state.work,
            received=received,
            recorded=state.keeper.landed,
            on_disk=state.on_disk,
            pace=request.pace,
        )

    async def _run_connections(
        self, request: BlobRequest, located: Located, state: FileState, turn: Turn | None
    ) -> None:
        """Fetch every missing range over up to ``connections_per_file`` connections (those
        of ``turn.share`` files in its turn). On a body path that counts what it reads (the
        pump) they start at a few and follow ``ConnectionRamp`` (more only while more bring
        more bytes per second); the aiohttp path opens them all at once."""
        missing = state.done.missing(state.size)
        most = self.config.connections_per_file
        if request.connections is not None:
            most = max(1, min(most, request.connections))
        if turn is not None:
            most *= max(1, turn.share)
            state.at_tail = turn.at_tail
        if state.single_stream:
            most = 1
        chunk = state.size if state.single_stream else self._chunk(missing, most, request)
        pieces = [
            (start + first, start + stop)
            for start, end in missing
            for first, stop in split_ranges(end - start, max(chunk, 1))
        ]
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        # the last round is cut finer for a file read in the config's ranges (a CDN's
        # connections are often capped one by one: they share it); an origin that sizes its
        # own ranges (an object store) gets them whole, since each extra range costs the
        # store a request and its connections are not capped one by one
        whole = state.single_stream or request.chunk_size is not None
        last_round = 0 if whole else most
        for piece in split_tail(pieces, last_round, _TAIL_PARTS, 2 * _MIN_SPLIT):
            queue.put_nowait(piece)
        assert state.body is not None
        body = state.body
        climbs = body.bytes_read is not None
        ramp = ConnectionRamp(most)
        state.wanted = ramp.count if climbs else most
        async with asyncio.TaskGroup() as tg:

            def closed(_: asyncio.Task[None]) -> None:
                state.connections -= 1

            def open_up_to(count: int) -> None:
                while state.connections < count:
                    state.connections += 1
                    work = self._ranges(request, located, state, body, queue)
                    tg.create_task(work).add_done_callback(closed)

            open_up_to(min(state.wanted, max(queue.qsize(), 1)))
            if climbs and ramp.count < most and queue.qsize() > state.connections:
                climbing = self._services.climbers.climbing
                climbing.add(state)
                try:
                    then, received = self._clock(), _bytes_read(body)
                    while not queue.empty():
                        with contextlib.suppress(TimeoutError):  # every interval, or as it drains
                            async with asyncio.timeout(_RAMP_EVERY):
                                await state.drained.wait()
                        if queue.empty():
                            break
                        now = self._clock()
                        rate = (_bytes_read(body) - received) / max(now - then, 1e-3)
                        then, received = now, _bytes_read(body)
                        if state.handed:
                            state.wanted, state.handed = ramp.grant(state.handed), 0
                        else:
                            state.wanted = ramp.observe(rate)
                        open_up_to(min(state.wanted, state.connections + queue.qsize()))
                finally:
                    climbing.discard(state)
        if state.done.total() != state.size:
            raise ProtocolError(f"{request.label}: transfer ended with bytes missing")
        if climbs:
            self._services.climbers.hand_on(state.wanted)

    def _chunk(
        self, missing: Sequence[tuple[int, int]], connections: int, request: BlobRequest
    ) -> int:
        """The request's ``chunk_size`` (else the config's) or less, so that every connection
        gets as many ranges as the others: a file ends with its last range, and an uneven last
        round (31 ranges over 8 connections) costs a whole range's time on a capped link.
        Never under ``_MIN_SPLIT``: each Range costs a round trip."""
        most = request.chunk_size or self.config.chunk_size
        left = sum(end - start for start, end in missing)
        rounds = max(1, -(-left // (most * connections)))
        even = -(-left // (rounds * connections))
        return min(most, max(_MIN_SPLIT, even))

    async def _ranges(
        self,
        request: BlobRequest,
        located: Located,
        state: FileState,
        body: Body,
        queue: asyncio.Queue[tuple[int, int]],
    ) -> None:
        """One connection's work: ranges off the queue until none are left, or until the
        file wants fewer connections than it has."""
        backoff = Backoff(self.config.retry)
        backoff_or_raise = self._services.backoff_or_raise
        while not queue.empty() and state.connections <= state.wanted:
            start, end = queue.get_nowait()
            if queue.empty():
                state.drained.set()
            while start < end:
                try:
                    written = await self._get_range(request, located, state, body, start, end)
                except TRANSIENT as exc:
                    covered = _covered_until(state.done, start)
                    if self._progressed(covered - start, end - start):
                        backoff.reset()
                    start = max(start, covered)
                    await backoff_or_raise(exc, request.label, backoff, None)
                    continue
                except RetryLater as later:
                    await backoff_or_raise(later, request.label, backoff, later.after)
                    continue
                if written == 0:
                    await backoff_or_raise(
                        ProtocolError(f"empty body for bytes {start}-{end - 1}"),
                        request.label,
                        backoff,
                        None,
                    )
                    continue
                wanted, start = end - start, start + written
                if self._progressed(written, wanted):
                    backoff.reset()
                elif start < end:  # a trickle per request: it must run out of attempts too
                    await backoff_or_raise(
                        ProtocolError(f"short body: {written} of {wanted} bytes"),
                        request.label,
                        backoff,
                        None,
                    )
        if queue.empty():
            state.at_tail()  # this connection is free: the next file may have it

    def _progressed(self, delivered: int, wanted: int) -> bool:
        """Progress that earns a fresh retry budget: the whole range, or one ``read_size``.
        Less must not, or a server that sends a byte per request is never given up on."""
        return delivered > 0 and delivered >= min(wanted, self.config.read_size)

    @staticmethod
    async def _get_range(
        request: BlobRequest, located: Located, state: FileState, body: Body, start: int, end: int
    ) -> int:
        """One Range request for [start, end); returns the bytes written (may be short)."""
        whole = state.single_stream and start == 0 and end == state.size
        if whole:
            headers = dict(located.headers)
        else:
            headers = range_headers(located.headers, start, end, state, request.validator)
        return await body.get_range(located.url, headers, start, end, whole=whole)

    # ------------------------------------------------------------------ hashing

    async def _hash(
        self, state: FileState, request: BlobRequest, store: StoreChecksum | None
    ) -> Digest:
        """Follow the contiguous prefix on disk: the digest is ready right after the last byte."""
        git_size = state.size if request.git_blob_id is not None else None
        digest = Digest(git_size=git_size, store=store)
        hashed = 0
        while hashed < state.size:
            frontier = state.done.contiguous_prefix()
            if frontier <= hashed:
                state.progressed.clear()
                await state.progressed.wait()
                continue
            got = await state.work.run(_hash_span, digest, state, hashed, frontier)
            if got < frontier:
                raise ProtocolError("partial file shrank while hashing")
            hashed = got
        return digest

    # ------------------------------------------------------------------ sidecar

    async def _keep_record(self, state: FileState) -> None:
        """Save the resume record every ``sidecar_interval`` while bytes it does not claim are
        on disk: the threads landing bytes save it every ``sidecar_bytes``, and on a slow
        link that can take long. A ``kill -9`` then loses about what was in flight."""
        while not state.closing:
            # wall time, not the retry clock; asyncio.timeout, not wait_for, whose 3.11
            # version can swallow a cancellation and keep a finished transfer waiting
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.sidecar_interval):
                    await state.closed.wait()
            if not state.closing:
                await state.work.run(state.keeper.save)


# ---------------------------------------------------------------------- helpers


def _bytes_read(body: Body) -> int:
    read = body.bytes_read
    assert read is not None  # asked only of a body that counts (``climbs``)
    return read


def _covered_until(done: RangeSet, start: int) -> int:
    """End of the downloaded interval that contains ``start`` (``start`` if none)."""
    for lo, hi in done.to_list():
        if lo <= start < hi:
            return hi
    return start


def _raise_first(group: BaseExceptionGroup[BaseException]) -> None:
    """Surface the most meaningful error of a task group, not the group itself."""
    leaves: list[BaseException] = []

    def walk(g: BaseExceptionGroup[BaseException]) -> None:
        for e in g.exceptions:
            if isinstance(e, BaseExceptionGroup):
                walk(e)
            else:
                leaves.append(e)

    walk(group)
    for kind in (Restart, Relocate, ShardsyncError):
        for e in leaves:
            if isinstance(e, kind):
                raise e
    raise leaves[0]


def _hash_span(digest: Digest, state: FileState, start: int, end: int) -> int:
    """Hash bytes ``[start, end)`` of the file, which are final, where they lie in the page
    cache (``MappedFile``). Every ``_WRITEBACK_EVERY`` bytes hashed are sent to the disk now
    rather than in the fsync before publishing. Returns where it got (short only if the
    file shrank)."""
    assert state.pages is not None
    got = state.pages.hash_into(digest, start, end)
    if got - state.written_back >= _WRITEBACK_EVERY or got == state.size:
        start_writeback(state.fd, state.written_back, got)
        state.written_back = got
    return got


def _close_transfer(state: FileState) -> None:
    """Close the file's body path and the hasher's window once no thread uses them."""
    if state.body is not None:
        state.body.close()
        state.body = None
    if state.pages is not None:
        state.pages.close()
        state.pages = None


def _resumable(request: BlobRequest, state: FileState) -> Resumable | None:
    """What the resume record binds the partial to; None without a strong ETag (yet)."""
    if state.etag is None:
        return None
    return Resumable(request.url, state.etag, state.size, request.sha256)
