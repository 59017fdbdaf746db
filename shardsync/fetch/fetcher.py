"""The fetcher: what every HTTP request means, and the retries around each file.

One pooled ``aiohttp`` session for metadata, redirects and proxied transfers (``session``:
redirects by hand, the proxy, timeouts). ``Fetcher``
locates a file (its redirects and ``HEAD``, ahead of time when asked), gets small documents
and byte ranges, and runs each file's download (``fetch``): one ``transfer.FileDownload`` per
attempt, a fresh one after a relocation (an expired URL) or a restart (the object changed),
until the bytes on disk hash to what was asked for. The slot's resume record says which
ranges are on disk so a later run resumes, but only with proof it is the same object
(``answers``: strong ETag + ``If-Range`` + a ``Content-Range`` that starts where we asked
and has the total we expect); anything else restarts the file from zero.

It picks each file's body path (``body_wire``: the pump on direct connections;
``body_aiohttp``: through a proxy, and for whole-file GETs) and hands the transfer what it
needs of the fetcher in ``transfer.Services``. ``sleep`` is injected so tests run retries
without patching.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import aiohttp

from shardsync.errors import (
    AuthError,
    HeaderError,
    IntegrityError,
    ProtocolError,
    ShardsyncError,
    StalledError,
    TransferError,
)
from shardsync.fetch.answers import (
    MAX_REDIRECTS,
    REDIRECTS,
    Relocate,
    Restart,
    RetryLater,
    describe,
    follow,
    int_or_none,
    is_retryable_exception,
    malformed,
    next_page,
    proxy_refused,
    retry_cause,
    unquote_etag,
)
from shardsync.fetch.body import Body, Landing, Traffic, Watchdog, mark_retrieved
from shardsync.fetch.body_aiohttp import AiohttpBody
from shardsync.fetch.body_wire import WireBody, serves
from shardsync.fetch.request import (
    BlobRequest,
    Located,
    ProgressFn,
    Sleep,
    Throttle,
    Turn,
    joined,
)
from shardsync.fetch.session import Session, default_timeout
from shardsync.fetch.transfer import Climbers, FileDownload, Services, Tally
from shardsync.network import NetworkConfig, ssl_context
from shardsync.ranges import format_range, parse_content_range
from shardsync.records import FetchConfig, FetchStatistics, VerifiedFile
from shardsync.retry import Backoff
from shardsync.safetensors_header import check_start
from shardsync.slot import Slot

__all__ = ["Fetcher", "IntoSlot"]

_T = TypeVar("_T")

_AheadKey = tuple[str, tuple[tuple[str, str], ...]]


def _ahead_key(request: BlobRequest) -> _AheadKey:
    """A located answer is only for the same URL asked with the same headers: in the
    daemon, a job must never take what another client's token found."""
    return request.url, tuple(sorted(request.headers.items()))


class Fetcher:
    """Downloads files with a shared session; one instance per process or daemon."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        config: FetchConfig | None = None,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        throttle: Throttle | None = None,
        network: NetworkConfig | None = None,
    ) -> None:
        self.config = config or FetchConfig()
        self.network = network or NetworkConfig()
        self._sleep = sleep
        self._clock = clock
        self._throttle = throttle
        self._traffic = Traffic()  # body bytes and requests in flight, fed by the bodies
        self._http = Session(session, self.config, self.network, self._traffic)
        self._files = 0
        self._retries: Counter[str] = Counter()
        self._verify_failures = 0
        self._tls: ssl.SSLContext | None = None
        self._ahead: dict[_AheadKey, asyncio.Task[Located]] = {}
        self._services = Services(  # all a file's transfer gets of this fetcher
            config=self.config,
            clock=clock,
            traffic=self._traffic,
            climbers=Climbers(),  # transfers whose ramp still has ranges to give
            probe_size=self._probe_size,
            open_body=self._open_body,
            backoff_or_raise=self._backoff_or_raise,
        )

    def tls(self) -> ssl.SSLContext:
        """The TLS context of body transfers, made once: loading the CA store costs tens of
        milliseconds, which every file and every retry would pay again."""
        if self._tls is None:
            self._tls = ssl_context(self.network)
        return self._tls

    @staticmethod
    def default_timeout(config: FetchConfig) -> aiohttp.ClientTimeout:
        """Explicit timeouts; no total cap (aiohttp's 300 s default would cut big files)."""
        return default_timeout(config)

    def statistics(self) -> FetchStatistics:
        return FetchStatistics(
            bytes_downloaded=self._traffic.bytes,
            files_fetched=self._files,
            active_connections=self._traffic.active,
            retries=dict(self._retries),
            verify_failures=self._verify_failures,
        )

    # ------------------------------------------------------------------ small requests

    async def get_bytes(
        self, url: str, headers: Mapping[str, str], *, max_size: int, label: str
    ) -> bytes:
        """GET a small document (API answer, listing) with the same retry policy."""
        body, _next = await self.get_page(url, headers, max_size=max_size, label=label)
        return body

    async def get_page(
        self, url: str, headers: Mapping[str, str], *, max_size: int, label: str
    ) -> tuple[bytes, str | None]:
        """``get_bytes`` for one page of a paginated listing, and the next page's URL
        (``Link: <...>; rel="next"``), which must stay on the same scheme, host and port:
        the request carries credentials."""

        async def once() -> tuple[bytes, str | None]:
            async with self._http.request("GET", url, headers, metadata=True) as resp:
                if resp.status == 200:
                    declared = resp.content_length
                    if declared is not None and declared > max_size:
                        raise ProtocolError(f"{label}: {declared} bytes exceeds {max_size}")
                    body = bytearray()
                    watchdog = Watchdog(self._clock, self.config)  # from the head on
                    async for piece in resp.content.iter_chunked(64 * 1024):
                        body += piece
                        if len(body) > max_size:
                            raise ProtocolError(f"{label}: body exceeds {max_size} bytes")
                        watchdog.count(len(piece))  # a trickle of small writes
                    return bytes(body), next_page(url, resp, label)
                await self._http.raise_for_status(resp, label)

        return await self._retried(label, once, StalledError)

    async def read_range(self, request: BlobRequest, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (e.g. a safetensors header), retried like the rest.

        Only a 206 for exactly the asked range is accepted, or a 200 whose body we cut
        to the range (a server that ignores Range); a short file gives what it has.
        """

        async def once() -> bytes:
            located = await self.locate(request)
            headers = {**located.headers, "Range": format_range(start, end - 1)}
            async with self._http.request("GET", located.url, headers) as resp:
                if resp.status == 206:
                    cr = parse_content_range(resp.headers.get("Content-Range", ""))
                    if cr is None or cr.start != start:
                        raise ProtocolError(
                            f"{request.label}: asked for bytes {start}-{end - 1}, got "
                            f"Content-Range {resp.headers.get('Content-Range')!r}"
                        )
                    return await _read_at_most(resp, min(end, cr.end + 1) - start)
                if resp.status == 200:
                    await _read_at_most(resp, start)  # skip what precedes the range
                    return await _read_at_most(resp, end - start)
                if resp.status == 416:
                    return b""
                await self._http.raise_for_status(resp, request.label)

        return await self._retried(request.label, once, ProtocolError)

    def locate_ahead(self, request: BlobRequest) -> None:
        """Start ``locate(request)`` now, for the next ``fetch`` of the same request to take
        instead of asking then: the first files' redirects and ``HEAD``s overlap what a job
        still waits for (its index), a round trip or two less before the first body byte.
        ``forget_ahead`` drops an answer no fetch took."""
        key = _ahead_key(request)
        if key not in self._ahead and not request.direct:  # a direct fetch asks nothing first
            task = asyncio.get_running_loop().create_task(self.locate(request))
            task.add_done_callback(mark_retrieved)
            self._ahead[key] = task

    def forget_ahead(self, request: BlobRequest | None = None) -> None:
        """Drop what ``locate_ahead(request)`` started, if no fetch took it (all of it
        without ``request``: the engine is closing)."""
        keys = list(self._ahead) if request is None else [_ahead_key(request)]
        for key in keys:
            task = self._ahead.pop(key, None)
            if task is not None:
                task.cancel()

    async def _locate_first(self, request: BlobRequest) -> Located:
        """The answer ``locate_ahead`` got for ``request``, else a fresh ``locate``; one
        that failed is asked again, so its error comes the usual way."""
        task = self._ahead.pop(_ahead_key(request), None)
        if task is not None:
            with contextlib.suppress(Exception):
                return await task
        if request.direct:
            return Located(
                request.url, request.headers, request.size, etag=None, linked_etag=None, commit=None
            )
        return await self.locate(request)

    async def locate(self, request: BlobRequest) -> Located:
        """HEAD the origin URL, following redirects by hand so credentials stay home."""
        return await self._retried(request.label, partial(self._locate_once, request))

    async def _retried(
        self,
        label: str,
        once: Callable[[], Awaitable[_T]],
        *also: type[Exception],
    ) -> _T:
        """``once()`` again, with backoff and ``Retry-After``, while it fails as a retry may
        mend (``RetryLater``, a dropped connection, a timeout, and ``also``)."""
        backoff = Backoff(self.config.retry)
        failed: tuple[type[Exception], ...] = (aiohttp.ClientError, TimeoutError, *also)
        while True:
            try:
                return await once()
            except RetryLater as later:
                await self._backoff_or_raise(later, label, backoff, later.after)
            except failed as exc:
                await self._backoff_or_raise(exc, label, backoff, None)

    async def _locate_once(self, request: BlobRequest) -> Located:
        if request.locator is not None:
            return await request.locator()
        url, headers = request.url, dict(request.headers)
        commit = linked = None
        linked_size: int | None = None
        for _ in range(MAX_REDIRECTS + 1):
            async with self._http.head(url, headers) as resp:
                commit = commit or resp.headers.get("X-Repo-Commit")
                linked = linked or unquote_etag(
                    resp.headers.get("X-Linked-Etag") or resp.headers.get("ETag")
                )
                if linked_size is None:
                    linked_size = int_or_none(resp.headers.get("X-Linked-Size"))
                if resp.status in REDIRECTS:
                    url, headers = follow(url, headers, resp.headers.get("Location"))
                    continue
                if resp.status != 200:
                    await self._http.raise_for_status(resp, request.label)
                size = linked_size if linked_size is not None else resp.content_length
                return Located(
                    url=url,
                    headers=headers,
                    size=request.size if request.size is not None else size,
                    etag=resp.headers.get("ETag"),
                    linked_etag=linked,
                    commit=commit,
                )
        raise ProtocolError(f"{request.label}: more than {MAX_REDIRECTS} redirects")

    # ------------------------------------------------------------------ big downloads

    async def fetch(
        self,
        request: BlobRequest,
        slot: Slot,
        on_progress: ProgressFn = lambda n: None,
        *,
        turn: Turn | None = None,
    ) -> VerifiedFile:
        """Download ``request`` into ``slot``, resuming from a partial it proves is this object.

        Returns only when every byte is on disk and the hash matched (or was
        recorded, for origins that publish none); the caller commits the slot. The
        partial is kept on error so the next run can resume. In its ``turn`` the file may
        take the connections of several. A mismatch after resuming an earlier run's partial
        is the partial's (a bad disk, a wrong seed): the file starts once more from zero
        without counting it against ``verify_attempts``, unless the request is ``seeded``.
        """
        verify_failures = 0
        single_stream = request.direct
        setbacks = Backoff(self.config.retry)  # restarts, and relocations without progress
        shown = 0
        tally = Tally()

        def progress(n: int) -> None:
            nonlocal shown
            shown += n
            on_progress(n)

        first = True
        try:
            while True:
                located = await (self._locate_first(request) if first else self.locate(request))
                first = False
                landed = tally.downloaded
                try:
                    result = await FileDownload(self._services).run(
                        request, located, slot, progress, single_stream, tally, turn
                    )
                except (Restart, Relocate) as exc:
                    cause = "restart" if isinstance(exc, Restart) else "relocate"
                    if isinstance(exc, Restart):
                        single_stream = single_stream or exc.single_stream
                        slot.abandon()
                        tally.resumed = 0  # nothing of an earlier run is reused after all
                    # the next attempt reports what is on disk again, as resumed: count it once
                    progress(-shown)
                    if cause == "relocate" and tally.downloaded - landed >= self.config.read_size:
                        # a URL that expired after bytes landed (kept for the next attempt)
                        # is no failure: a long file outlives many. A restart drops them.
                        setbacks.reset()
                    delay = setbacks.next_delay()
                    if delay is None:
                        raise TransferError(
                            f"{request.label}: gave up after repeated {cause}s: {exc}"
                        ) from None
                    self._retries[cause] += 1
                    await self._sleep(delay)
                    continue
                if result is not None:
                    self._files += 1
                    return result
                self._verify_failures += 1
                slot.abandon()
                partials = bool(tally.resumed) and not request.seeded  # its bytes, not the origin's
                tally.resumed = 0
                progress(-shown)
                if partials:
                    continue  # once more, from zero: nothing is resumed now
                verify_failures += 1
                attempts = request.verify_attempts or self.config.max_verify_attempts
                if verify_failures >= attempts:
                    raise IntegrityError(
                        f"{request.label}: hash mismatch after {verify_failures} downloads; "
                        "the origin serves different bytes than it advertises"
                    )
        except BaseException:
            progress(-shown)  # a failed fetch holds nothing: whoever goes on counts afresh
            raise

    async def _probe_size(self, located: Located, label: str) -> int:
        """Origins that omit Content-Length on HEAD: ask for one byte and read the total
        (retried as every request of a file is: a 503 here is no answer yet)."""
        headers = {**located.headers, "Range": format_range(0, 0)}

        async def once() -> int:
            async with self._http.request("GET", located.url, headers) as resp:
                if resp.status == 206:
                    cr = parse_content_range(resp.headers.get("Content-Range", ""))
                    if cr is not None and cr.total is not None:
                        return cr.total
                if resp.status == 200 and resp.content_length is not None:
                    return resp.content_length
                if resp.status >= 300:
                    await self._http.raise_for_status(resp, label)
            raise ProtocolError(f"{label}: the origin does not say how large the file is")

        return await self._retried(label, once)

    def _open_body(self, url: str, landing: Landing, whole_only: bool) -> Body:
        """A file's body path: the pump on direct http(s) connections, else aiohttp (through
        a proxy; and one whole-file GET, a direct request or a restart in one stream, which
        needs no worker threads started for it). The pump hands aiohttp what only it reads."""
        throttle = joined(self._throttle, landing.pace)
        plain = AiohttpBody(
            landing,
            send=self._http.request,
            refuse=self._http.raise_for_status,
            config=self.config,
            clock=self._clock,
            throttle=throttle,
        )
        if whole_only or not serves(url, self.network):
            return plain
        return WireBody(
            landing,
            plain,
            self.tls() if urlsplit(url).scheme == "https" else None,
            config=self.config,
            clock=self._clock,
            throttle=throttle,
            headers=self._http.headers,
            traffic=self._traffic,
        )

    async def _backoff_or_raise(
        self, exc: BaseException, label: str, backoff: Backoff, retry_after: float | None
    ) -> None:
        cause = retry_cause(exc)
        if isinstance(exc, aiohttp.ClientHttpProxyError):  # the proxy refused a CONNECT
            if exc.status == 407:
                sent = self._http.proxy_auth(str(exc.request_info.url)) is not None
                raise AuthError(f"{label}: {proxy_refused(sent)}") from None
            exc = RetryLater(f"proxy answered HTTP {exc.status}", after=None, status=exc.status)
        elif isinstance(exc, aiohttp.ClientResponseError):  # an answer aiohttp cannot parse
            exc = malformed(exc, label)
        retryable = isinstance(exc, (RetryLater, StalledError, ProtocolError)) or (
            is_retryable_exception(exc)
        )
        if not retryable:
            raise TransferError(f"{label}: {describe(exc)}") from exc
        delay = backoff.next_delay(retry_after)
        if delay is None:
            if isinstance(exc, ShardsyncError) and not isinstance(exc, RetryLater):
                raise exc
            raise TransferError(
                f"{label}: giving up after {backoff.attempts} attempts, last error: {describe(exc)}"
            ) from exc
        self._retries[cause] += 1
        await self._sleep(delay)


async def _read_at_most(resp: aiohttp.ClientResponse, n: int) -> bytes:
    body = bytearray()
    while len(body) < n:
        piece = await resp.content.read(n - len(body))
        if not piece:
            break
        body += piece
    return bytes(body)


class IntoSlot:
    """One download slot as an origin or the tier fills it (``origins.base.Into``): a
    request through the fetcher, in the file's ``turn`` when it streams in one (the file
    then gets the turn's connections), its reads held back by ``pace`` if given (a claim
    holder's ``tier_parts.Lead``), or a copy of a file the origin opens itself.
    ``verify_once``: a hash mismatch is raised at once (``IntegrityError``), not downloaded
    again: the slot was seeded from the tier's parts, which the tier then deletes."""

    __slots__ = ("_fetcher", "_once", "_pace", "_slot", "_turn")

    def __init__(
        self,
        fetcher: Fetcher,
        slot: Slot,
        turn: Turn | None = None,
        pace: Throttle | None = None,
        *,
        verify_once: bool = False,
    ) -> None:
        self._fetcher = fetcher
        self._slot = slot
        self._turn = turn
        self._pace = pace
        self._once = verify_once

    async def fetch(self, request: BlobRequest, progress: ProgressFn) -> VerifiedFile:
        if self._pace is not None:
            request = dataclasses.replace(request, pace=self._pace)
        if self._once:
            request = dataclasses.replace(request, verify_attempts=1, seeded=True)
        file = await self._fetcher.fetch(request, self._slot, progress, turn=self._turn)
        return await self._shaped(file, request.label)

    async def copy(self, source: Path, version: str | None, name: str) -> VerifiedFile:
        copying = asyncio.ensure_future(asyncio.to_thread(self._slot.copy_from, source, version))
        try:
            file = await asyncio.shield(copying)
        except asyncio.CancelledError:
            # the thread copies on to its end: what it made then goes (a copy is never
            # resumed), or a job that failed beside it left whole copies in tmp/ for as long
            # as its process lived
            copying.add_done_callback(self._drop_copy)
            raise
        return await self._shaped(file, name)

    async def _shaped(self, file: VerifiedFile, name: str) -> VerifiedFile:
        """``file``, unless it is a ``.safetensors`` nothing verified (a plain URL, a store
        keeping no checksum) that does not start as one: a server's login page or error body
        answered for a shard. That is refused before it is published, and dropped."""
        if file.verified != "tofu" or not name.endswith(".safetensors"):
            return file

        def check() -> None:
            with file.path.open("rb") as f:
                start = f.read(9)
            try:
                check_start(start, shard=name, file_size=file.size)
            except HeaderError:
                self._slot.abandon()
                raise

        await asyncio.to_thread(check)
        return file

    @staticmethod
    def _drop_copy(copying: asyncio.Future[VerifiedFile]) -> None:
        # the file itself, by the name the thread gave it: the slot forgot that name at the
        # cancel already, if the thread had given it by then
        if not copying.cancelled() and copying.exception() is None:
            copying.result().path.unlink(missing_ok=True)
