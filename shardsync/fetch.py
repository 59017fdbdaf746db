"""The transfer engine: what every HTTP request and answer means.

One pooled ``aiohttp`` session for metadata, redirects and proxied transfers; per file,
several Range requests pulling chunks in ascending order from a shared queue. Their bodies
land at their offsets in the partial file: read by ``shardsync.wire``'s per-file pump thread
(direct connections), or received by aiohttp and ``pwritev``-ed (through a proxy). A hasher
follows the contiguous prefix on disk, reading it through a mapping, so sha256 (and xxh3-128
for fast re-checks) is ready moments after the last byte without a second pass over the
network. The slot's resume record says which ranges are on disk so a later run resumes, but
only with proof it is the same object (strong ETag + ``If-Range`` + a ``Content-Range`` that
starts where we asked and has the total we expect); anything else restarts the file from
zero.

``sleep`` is injected so tests run retries without patching.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar
from urllib.parse import urljoin, urlsplit, urlunsplit

import aiohttp

from shardsync.checksums import StoreChecksum
from shardsync.digest import Digest, MappedFile
from shardsync.errors import (
    AuthError,
    EntryNotFoundError,
    IntegrityError,
    OriginError,
    ProtocolError,
    RepoNotFoundError,
    RevisionNotFoundError,
    ShardsyncError,
    StalledError,
    TransferError,
    disk_error,
    redact,
)
from shardsync.network import NetworkConfig, ssl_context
from shardsync.ramp import ConnectionRamp
from shardsync.ranges import (
    RangeSet,
    format_range,
    is_strong_etag,
    parse_content_range,
    parse_unsatisfied_range,
    split_ranges,
    split_tail,
)
from shardsync.records import FetchConfig, FetchStatistics, Verification
from shardsync.retry import Backoff, classify_status, parse_retry_after
from shardsync.slot import RecordKeeper, Resumable, Slot, VerifiedFile
from shardsync.wire import (
    Pump,
    RangeReader,
    Stream,
    start_writeback,
    write_all,
)

__all__ = [
    "BlobRequest",
    "Fetcher",
    "Located",
    "Locator",
    "Sleep",
    "Throttle",
    "Validator",
    "is_retryable_exception",
    "redact_url",
]

MiB = 1 << 20
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_MAX_REDIRECTS = 5
_MIN_SPLIT = MiB  # the smallest Range worth a connection of its own
_TAIL_PARTS = 4  # the last round of ranges is cut in this many (``split_tail``)
_RAMP_EVERY = 0.1  # seconds between the connection ramp's looks at a file's rate
_WRITEBACK_EVERY = 8 * MiB  # hashed bytes sent to the disk at once
_ERROR_BODY = 4096  # bytes of an error answer read for its message
_CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization", "x-amz-security-token")

_T = TypeVar("_T")
Sleep = Callable[[float], Awaitable[None]]
Validator = Literal["If-Range", "If-Match"]
Throttle = Callable[[int], float]
"""Told each body read's size, on the event loop or on a pump thread (so it must be
thread-safe), it answers how many seconds that reader pauses (0: none): a shared bandwidth
budget (the daemon's token bucket). Raising stops the transfer."""
Header = Callable[[str], "str | None"]  # a response header by case-insensitive name
ProgressFn = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class Located:
    """Where a file's bytes are, after following redirects from the origin URL."""

    url: str
    headers: Mapping[str, str]  # credentials only when ``url`` is on the origin host
    size: int | None
    etag: str | None  # the data URL's own ETag, as sent (quoted)
    linked_etag: str | None  # X-Linked-Etag / ETag of the origin answer, unquoted
    commit: str | None  # X-Repo-Commit
    checksum: StoreChecksum | None = None  # what the store keeps for exactly this ETag


Locator = Callable[[], Awaitable[Located]]
"""Finds where a file's bytes are now (e.g. signs a fresh URL); asked again after a 401/403."""


@dataclass(frozen=True, slots=True)
class BlobRequest:
    """One file to fetch: its origin URL and what we already know about it.

    ``url`` names the object (a resume record is bound to it). Without a ``locator`` the
    fetcher finds the bytes by a HEAD of ``url``, following redirects. ``validator`` is the
    header that ties each Range request to the ETag first seen: ``If-Range`` (a changed
    object answers 200) or ``If-Match`` (it answers 412; for stores without ``If-Range``).

    ``direct``: a small file whose hash is known (a config, an index). It is fetched whole
    with one GET of ``url``, redirects followed by hand, on the shared connections: no HEAD
    first, no Range, no resume. The hash, not an ETag, says the bytes are the ones asked for.
    A relocation or restart asks the usual way.
    """

    url: str
    headers: Mapping[str, str]
    label: str  # repo path, for messages and progress
    size: int | None = None
    sha256: str | None = None
    git_blob_id: str | None = None
    locator: Locator | None = None
    validator: Validator = "If-Range"
    verify_attempts: int | None = None  # full downloads after a mismatch (None: the config's)
    direct: bool = False
    connections: int | None = None  # most connections (an origin's own cap; None: the config's)


def is_retryable_exception(exc: BaseException) -> bool:
    """Whether a failed request is worth another attempt.

    Connection drops, truncated bodies and timeouts are; TLS certificate or
    handshake failures, bad URLs and everything else are not.
    """
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLCertVerificationError):
        return False
    return isinstance(
        exc,
        aiohttp.ClientPayloadError
        | aiohttp.ClientConnectionError
        | asyncio.TimeoutError
        | ConnectionError
        | socket.gaierror  # a name lookup that failed may succeed in a moment
        | ssl.SSLEOFError,  # the peer dropped a TLS connection
    )


@dataclass(slots=True)
class _Tally:
    """One ``fetch`` call's counts across its attempts (relocations, restarts)."""

    downloaded: int = 0
    resumed: int | None = None  # from an earlier run: set by the first attempt


class _Restart(Exception):
    """The object changed or Range support failed: discard the partial and start over."""

    def __init__(self, reason: str, *, etag: str | None, single_stream: bool) -> None:
        super().__init__(reason)
        self.etag = etag
        self.single_stream = single_stream


class _Relocate(Exception):
    """The data URL stopped working (expired signature): ask the origin again."""


class _Watchdog:
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


@dataclass(frozen=True, slots=True)
class _Wire:
    """One file's body transfers off the loop: its connections, the threads that open them
    (connect, send, read the head: blocking) and the pump that reads every body."""

    reader: RangeReader
    threads: ThreadPoolExecutor
    pump: Pump

    def close(self) -> None:
        self.pump.close()
        self.threads.shutdown(wait=False)
        self.reader.close()


@dataclass(slots=True, eq=False)  # one per transfer, compared and hashed by identity
class _FileState:
    """Mutable per-file transfer state shared by its connections."""

    fd: int
    size: int
    etag: str | None
    done: RangeSet
    single_stream: bool
    downloaded: int = 0
    closing: bool = False  # the connections are done: the record keeper stops
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # ``closing`` became true
    in_flight: set[asyncio.Future[Any]] = field(default_factory=set)
    etag_lock: threading.Lock = field(default_factory=threading.Lock)
    pages: MappedFile | None = None  # what the hasher reads the file through
    wire: _Wire | None = None  # worker threads writing bodies to ``fd``
    connections: int = 0  # running
    wanted: int = 0  # what the ramp asks for: a connection beyond it takes no next range
    handed: int = 0  # connections a finished file handed on to this one, not yet taken
    unframed: bool = False  # the server sent a body without a length: aiohttp reads them all
    drained: asyncio.Event = field(default_factory=asyncio.Event)  # every range is taken
    written_back: int = 0  # bytes [0, this) have been sent to the disk (``start_writeback``)
    keeper: RecordKeeper = field(init=False)  # the resume record, told first (on the thread)

    def on_disk(self, first: int, stop: int) -> None:
        """Bytes ``[first, stop)`` are in the file (``keeper`` knows already): the hasher
        may follow them."""
        self.done.add(first, stop)
        self.progressed.set()

    def start_in_thread(
        self, fn: Callable[..., _T], *args: object, executor: Executor | None = None
    ) -> asyncio.Future[_T]:
        """Start blocking file I/O on ``fd`` in a thread, tracked so ``fd`` outlives it.

        A cancelled coroutine does not stop its thread; closing ``fd`` under a running
        ``pwrite`` could write into whatever file reuses the descriptor number. Await the
        result through ``asyncio.shield`` so a cancellation never marks it done early.
        """
        future = asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        self.in_flight.add(future)
        future.add_done_callback(self.in_flight.discard)
        future.add_done_callback(_mark_retrieved)
        return future

    async def in_thread(self, fn: Callable[..., _T], *args: object) -> _T:
        return await asyncio.shield(self.start_in_thread(fn, *args))

    async def drain(self) -> None:
        """Wait for every thread still using ``fd`` (even after a cancellation)."""
        while self.in_flight:
            await asyncio.wait(set(self.in_flight))


def _next_page(url: str, resp: aiohttp.ClientResponse, label: str) -> str | None:
    link = resp.links.get("next")
    if link is None:
        return None
    target = urljoin(str(resp.url), str(link["url"]))
    if _origin_of(target) != _origin_of(url):
        raise ProtocolError(
            f"{label}: refusing a next page on another origin: {redact_url(target)}"
        )
    return target


_AheadKey = tuple[str, tuple[tuple[str, str], ...]]


def _ahead_key(request: BlobRequest) -> _AheadKey:
    """A located answer is only for the same URL asked with the same headers: in the
    daemon, a job must never take what another client's token found."""
    return request.url, tuple(sorted(request.headers.items()))


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Its awaiter may be gone (cancelled by a sibling's error, e.g. several writes hitting
    ENOSPC at once): the error is reported once, by the first, not logged by asyncio again."""
    if not future.cancelled():
        future.exception()


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
        self._session = session
        self.config = config or FetchConfig()
        self.network = network or NetworkConfig()
        self._sleep = sleep
        self._clock = clock
        self._throttle = throttle
        self._bytes = 0
        self._files = 0
        self._active = 0
        self._retries: Counter[str] = Counter()
        self._verify_failures = 0
        self._tls: ssl.SSLContext | None = None
        self._timeout = self.default_timeout(self.config)
        self._ahead: dict[_AheadKey, asyncio.Task[Located]] = {}
        self._climbing: set[_FileState] = set()  # transfers whose ramp still has ranges to give

    def tls(self) -> ssl.SSLContext:
        """The TLS context of body transfers, made once: loading the CA store costs tens of
        milliseconds, which every file and every retry would pay again."""
        if self._tls is None:
            self._tls = ssl_context(self.network)
        return self._tls

    @staticmethod
    def default_timeout(config: FetchConfig) -> aiohttp.ClientTimeout:
        """Explicit timeouts; no total cap (aiohttp's 300 s default would cut big files)."""
        return aiohttp.ClientTimeout(
            total=None,
            connect=config.connect_timeout,
            sock_connect=config.connect_timeout,
            sock_read=config.read_timeout,
        )

    def statistics(self) -> FetchStatistics:
        return FetchStatistics(
            bytes_downloaded=self._bytes,
            files_fetched=self._files,
            active_connections=self._active,
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
        backoff = Backoff(self.config.retry)
        while True:
            try:
                async with self._request("GET", url, headers, metadata=True) as resp:
                    if resp.status == 200:
                        declared = resp.content_length
                        if declared is not None and declared > max_size:
                            raise ProtocolError(f"{label}: {declared} bytes exceeds {max_size}")
                        body = bytearray()
                        async for piece in resp.content.iter_chunked(64 * 1024):
                            body += piece
                            if len(body) > max_size:
                                raise ProtocolError(f"{label}: body exceeds {max_size} bytes")
                        return bytes(body), _next_page(url, resp, label)
                    await self._raise_for_status(resp, label)
            except _RetryLater as later:
                await self._backoff_or_raise(later, label, backoff, later.after)
            except (aiohttp.ClientError, TimeoutError) as exc:
                await self._backoff_or_raise(exc, label, backoff, None)

    async def read_range(self, request: BlobRequest, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file (e.g. a safetensors header), retried like the rest.

        Only a 206 for exactly the asked range is accepted, or a 200 whose body we cut
        to the range (a server that ignores Range); a short file gives what it has.
        """
        backoff = Backoff(self.config.retry)
        while True:
            try:
                located = await self.locate(request)
                headers = {**located.headers, "Range": format_range(start, end - 1)}
                async with self._request("GET", located.url, headers) as resp:
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
                    await self._raise_for_status(resp, request.label)
            except _RetryLater as later:
                await self._backoff_or_raise(later, request.label, backoff, later.after)
            except (aiohttp.ClientError, TimeoutError, ProtocolError) as exc:
                await self._backoff_or_raise(exc, request.label, backoff, None)

    def _hand_on(self, count: int) -> None:
        """A transfer ended holding ``count`` connections: the host was carrying them a moment
        ago, so the transfers still climbing take them at once, shared out, instead of each
        climbing step by step while the last file ends alone on a few connections."""
        takers = list(self._climbing)
        for state in takers:
            state.handed += -(-count // len(takers))

    def locate_ahead(self, request: BlobRequest) -> None:
        """Start ``locate(request)`` now, for the next ``fetch`` of the same request to take
        instead of asking then: the first files' redirects and ``HEAD``s overlap what a job
        still waits for (its index), a round trip or two less before the first body byte.
        ``forget_ahead`` drops an answer no fetch took."""
        key = _ahead_key(request)
        if key not in self._ahead and not request.direct:  # a direct fetch asks nothing first
            task = asyncio.get_running_loop().create_task(self.locate(request))
            task.add_done_callback(_mark_retrieved)
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
        backoff = Backoff(self.config.retry)
        while True:
            try:
                return await self._locate_once(request)
            except _RetryLater as later:
                await self._backoff_or_raise(later, request.label, backoff, later.after)
            except (aiohttp.ClientError, TimeoutError) as exc:
                await self._backoff_or_raise(exc, request.label, backoff, None)

    async def _locate_once(self, request: BlobRequest) -> Located:
        if request.locator is not None:
            return await request.locator()
        url, headers = request.url, dict(request.headers)
        commit = linked = None
        linked_size: int | None = None
        for _ in range(_MAX_REDIRECTS + 1):
            async with self._session.head(
                url,
                headers=self._headers(url, headers),
                allow_redirects=False,
                timeout=self._metadata_timeout(),
                **self._proxy(url),
            ) as resp:
                commit = commit or resp.headers.get("X-Repo-Commit")
                linked = linked or _unquote_etag(
                    resp.headers.get("X-Linked-Etag") or resp.headers.get("ETag")
                )
                if linked_size is None:
                    linked_size = _int_or_none(resp.headers.get("X-Linked-Size"))
                if resp.status in _REDIRECTS:
                    url, headers = _follow(url, headers, resp.headers.get("Location"))
                    continue
                if resp.status != 200:
                    await self._raise_for_status(resp, request.label)
                size = linked_size if linked_size is not None else resp.content_length
                return Located(
                    url=url,
                    headers=headers,
                    size=request.size if request.size is not None else size,
                    etag=resp.headers.get("ETag"),
                    linked_etag=linked,
                    commit=commit,
                )
        raise ProtocolError(f"{request.label}: more than {_MAX_REDIRECTS} redirects")

    # ------------------------------------------------------------------ big downloads

    async def fetch(
        self,
        request: BlobRequest,
        slot: Slot,
        on_progress: ProgressFn = lambda n: None,
    ) -> VerifiedFile:
        """Download ``request`` into ``slot``, resuming from a partial it proves is this object.

        Returns only when every byte is on disk and the hash matched (or was
        recorded, for origins that publish none); the caller commits the slot. The
        partial is kept on error so the next run can resume.
        """
        verify_failures = 0
        single_stream = request.direct
        setbacks = Backoff(self.config.retry)  # restarts and relocations, bounded too
        shown = 0
        tally = _Tally()

        def progress(n: int) -> None:
            nonlocal shown
            shown += n
            on_progress(n)

        first = True
        try:
            while True:
                located = await (self._locate_first(request) if first else self.locate(request))
                first = False
                try:
                    result = await _FileDownload(self).run(
                        request, located, slot, progress, single_stream, tally
                    )
                except (_Restart, _Relocate) as exc:
                    cause = "restart" if isinstance(exc, _Restart) else "relocate"
                    if isinstance(exc, _Restart):
                        single_stream = single_stream or exc.single_stream
                        slot.abandon()
                        tally.resumed = 0  # nothing of an earlier run is reused after all
                    # the next attempt reports what is on disk again, as resumed: count it once
                    progress(-shown)
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
                verify_failures += 1
                self._verify_failures += 1
                slot.abandon()
                tally.resumed = 0
                progress(-shown)
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
        """Origins that omit Content-Length on HEAD: ask for one byte and read the total."""
        headers = {**located.headers, "Range": format_range(0, 0)}
        async with self._request("GET", located.url, headers) as resp:
            if resp.status == 206:
                cr = parse_content_range(resp.headers.get("Content-Range", ""))
                if cr is not None and cr.total is not None:
                    return cr.total
            if resp.status == 200 and resp.content_length is not None:
                return resp.content_length
        raise ProtocolError(f"{label}: the origin does not say how large the file is")

    # ------------------------------------------------------------------ HTTP plumbing

    @contextlib.asynccontextmanager
    async def _request(
        self, method: str, url: str, headers: Mapping[str, str], *, metadata: bool = False
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A request with redirects followed by hand (credentials never leave the origin),
        each hop through the proxy ``NO_PROXY`` leaves it. ``metadata``: an API answer or
        listing, which a mirror may fetch upstream first (its own, longer, read timeout)."""
        hdrs = dict(headers)
        for _ in range(_MAX_REDIRECTS + 1):
            self._active += 1
            try:
                async with self._session.request(
                    method,
                    url,
                    headers=self._headers(url, hdrs),
                    allow_redirects=False,
                    # always explicit: None would mean no timeout at all, not the session's
                    timeout=self._metadata_timeout() if metadata else self._timeout,
                    **self._proxy(url),
                ) as resp:
                    if resp.status not in _REDIRECTS:
                        yield resp
                        return
                    location = resp.headers.get("Location")
            finally:
                self._active -= 1
            url, hdrs = _follow(url, hdrs, location)
        raise ProtocolError(f"more than {_MAX_REDIRECTS} redirects for {redact_url(url)}")

    def _headers(self, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        """Ours, then the configured ones for this host, then the request's own."""
        merged = _with_defaults({})
        merged.update(self.network.extra_headers(url))
        merged.update(headers)
        auth = self._proxy_auth(url)
        if auth is not None and urlsplit(url).scheme == "http":
            # a plain-http request goes to the proxy itself, so its credentials go in it;
            # aiohttp sends ``proxy_headers`` on a CONNECT only (a 407 here, before)
            merged["Proxy-Authorization"] = auth
        return merged

    def _proxy(self, url: str) -> dict[str, Any]:
        """Where the request goes through, and for a ``CONNECT`` (https) its credentials:
        inside the tunnel they would reach the origin."""
        proxy = self.network.proxy_for(url)
        if proxy is None:
            return {}
        auth = self._proxy_auth(url)
        if auth is None or urlsplit(url).scheme == "http":
            return {"proxy": proxy.url}
        return {"proxy": proxy.url, "proxy_headers": {"Proxy-Authorization": auth}}

    def _proxy_auth(self, url: str) -> str | None:
        proxy = self.network.proxy_for(url)
        if proxy is None or proxy.username is None:
            return None
        return aiohttp.encode_basic_auth(proxy.username, proxy.password or "")

    def _metadata_timeout(self) -> aiohttp.ClientTimeout:
        cfg = self.config
        return aiohttp.ClientTimeout(
            total=None,
            connect=cfg.connect_timeout,
            sock_connect=cfg.connect_timeout,
            sock_read=max(cfg.read_timeout, self.network.metadata_timeout),
        )

    async def _raise_for_status(
        self, resp: aiohttp.ClientResponse, label: str, *, relocatable: bool = False
    ) -> None:
        """Turn a non-success answer into an exception (retryable ones as ``_RetryLater``)."""
        body = b""
        with contextlib.suppress(Exception):
            body = await resp.content.read(_ERROR_BODY)
        if resp.status == 407:
            sent = self._proxy_auth(str(resp.url)) is not None
            raise AuthError(f"{label}: {_proxy_refused(sent)}")
        raise _status_error(resp.status, resp.headers.get, body, label, relocatable=relocatable)

    async def _backoff_or_raise(
        self, exc: BaseException, label: str, backoff: Backoff, retry_after: float | None
    ) -> None:
        cause = _cause(exc)
        if isinstance(exc, aiohttp.ClientHttpProxyError):  # the proxy refused a CONNECT
            if exc.status == 407:
                sent = self._proxy_auth(str(exc.request_info.url)) is not None
                raise AuthError(f"{label}: {_proxy_refused(sent)}") from None
            exc = _RetryLater(f"proxy answered HTTP {exc.status}", after=None, status=exc.status)
        elif isinstance(exc, aiohttp.ClientResponseError):  # an answer aiohttp cannot parse
            exc = _malformed(exc, label)
        retryable = isinstance(exc, (_RetryLater, StalledError, ProtocolError)) or (
            is_retryable_exception(exc)
        )
        if not retryable:
            raise TransferError(f"{label}: {_describe(exc)}") from exc
        delay = backoff.next_delay(retry_after)
        if delay is None:
            if isinstance(exc, ShardsyncError) and not isinstance(exc, _RetryLater):
                raise exc
            raise TransferError(
                f"{label}: giving up after {backoff.attempts} attempts, last error: "
                f"{_describe(exc)}"
            ) from exc
        self._retries[cause] += 1
        await self._sleep(delay)


class _FileDownload:
    """One attempt at one file: its connections, their bodies, the hash that follows them and
    the resume record that follows what is on disk. ``Fetcher.fetch`` makes one per attempt
    (a relocation or a restart starts another) and owns the retries around it."""

    def __init__(self, fetcher: Fetcher) -> None:
        self._fetcher = fetcher  # HTTP plumbing, retry decisions and the shared counters
        self.config = fetcher.config
        self.network = fetcher.network
        self._clock = fetcher._clock
        self._throttle = fetcher._throttle

    async def run(
        self,
        request: BlobRequest,
        located: Located,
        slot: Slot,
        on_progress: ProgressFn,
        single_stream: bool,
        tally: _Tally,
    ) -> VerifiedFile | None:
        size = located.size
        if size is None:
            size = await self._fetcher._probe_size(located, request.label)
        if request.size is not None and size != request.size:
            raise ProtocolError(
                f"{request.label}: origin reports {size} bytes, manifest says {request.size}"
            )
        etag = located.etag if is_strong_etag(located.etag) else None
        opened = slot.open(Resumable(request.url, etag, size, request.sha256))
        fd, done, record = opened.fd, opened.done, opened.record
        resumed = done.total()
        if tally.resumed is None:
            tally.resumed = resumed
        state = _FileState(fd=fd, size=size, etag=etag, done=done, single_stream=single_stream)
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
                if not whole_only and self._wire_serves(located.url):
                    state.wire = self._open_wire(located.url, fd)
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
                        await self._run_connections(request, located, state, on_progress)
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
                    await state.drain()  # no thread may still use ``fd`` when it closes
                    _close_transfer(state)
                    tally.downloaded += state.downloaded
                    try:
                        await state.in_thread(state.keeper.save)
                    finally:
                        os.close(fd)
                        if record is not None:
                            record.close()

                await _to_the_end(wind_up())
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

    def _wire_serves(self, url: str) -> bool:
        """Bodies go through worker threads on direct http(s) connections; through a proxy
        they take the aiohttp path, which speaks to proxies."""
        return urlsplit(url).scheme in ("http", "https") and self.network.proxy_for(url) is None

    def _open_wire(self, url: str, fd: int) -> _Wire:
        cfg = self.config
        context = self._fetcher.tls() if urlsplit(url).scheme == "https" else None
        reader = RangeReader(
            context, connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout
        )
        threads = ThreadPoolExecutor(cfg.connections_per_file, thread_name_prefix="shardsync-open")
        pump = Pump(
            fd,
            read_size=cfg.read_size,
            report_size=cfg.write_size,
            read_timeout=cfg.read_timeout,
            clock=self._clock,
            throttle=self._throttle,
        )
        return _Wire(reader, threads, pump)

    async def _run_connections(
        self, request: BlobRequest, located: Located, state: _FileState, on_progress: ProgressFn
    ) -> None:
        """Fetch every missing range over up to ``connections_per_file`` connections. Through
        the pump they start at a few and follow ``ConnectionRamp`` (more only while more
        bring more bytes per second); the aiohttp path opens them all at once."""
        missing = state.done.missing(state.size)
        most = self.config.connections_per_file
        if state.single_stream:
            most = 1
        elif request.connections is not None:
            most = max(1, min(most, request.connections))
        chunk = state.size if state.single_stream else self._chunk(missing, most)
        pieces = [
            (start + first, start + stop)
            for start, end in missing
            for first, stop in split_ranges(end - start, max(chunk, 1))
        ]
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        last_round = 0 if state.single_stream else most
        for piece in split_tail(pieces, last_round, _TAIL_PARTS, 2 * _MIN_SPLIT):
            queue.put_nowait(piece)
        pump = state.wire.pump if state.wire is not None else None
        ramp = ConnectionRamp(most)
        state.wanted = most if pump is None else ramp.count
        async with asyncio.TaskGroup() as tg:

            def closed(_: asyncio.Task[None]) -> None:
                state.connections -= 1

            def open_up_to(count: int) -> None:
                while state.connections < count:
                    state.connections += 1
                    work = self._ranges(request, located, state, queue, on_progress)
                    tg.create_task(work).add_done_callback(closed)

            open_up_to(min(state.wanted, max(queue.qsize(), 1)))
            if pump is not None and ramp.count < most and queue.qsize() > state.connections:
                climbing = self._fetcher._climbing
                climbing.add(state)
                try:
                    then, received = self._clock(), pump.received
                    while not queue.empty():
                        with contextlib.suppress(TimeoutError):  # every interval, or as it drains
                            async with asyncio.timeout(_RAMP_EVERY):
                                await state.drained.wait()
                        if queue.empty():
                            break
                        now = self._clock()
                        rate = (pump.received - received) / max(now - then, 1e-3)
                        then, received = now, pump.received
                        if state.handed:
                            state.wanted, state.handed = ramp.grant(state.handed), 0
                        else:
                            state.wanted = ramp.observe(rate)
                        open_up_to(min(state.wanted, state.connections + queue.qsize()))
                finally:
                    climbing.discard(state)
        if state.done.total() != state.size:
            raise ProtocolError(f"{request.label}: transfer ended with bytes missing")
        if pump is not None:
            self._fetcher._hand_on(state.wanted)

    def _chunk(self, missing: Sequence[tuple[int, int]], connections: int) -> int:
        """``chunk_size`` or less, so that every connection gets as many ranges as the others:
        a file ends with its last range, and an uneven last round (31 ranges over 8
        connections) costs a whole range's time on a capped link. Never under ``_MIN_SPLIT``:
        each Range costs a round trip."""
        left = sum(end - start for start, end in missing)
        rounds = max(1, -(-left // (self.config.chunk_size * connections)))
        even = -(-left // (rounds * connections))
        return min(self.config.chunk_size, max(_MIN_SPLIT, even))

    async def _ranges(
        self,
        request: BlobRequest,
        located: Located,
        state: _FileState,
        queue: asyncio.Queue[tuple[int, int]],
        on_progress: ProgressFn,
    ) -> None:
        """One connection's work: ranges off the queue until none are left, or until the
        file wants fewer connections than it has."""
        backoff = Backoff(self.config.retry)
        while not queue.empty() and state.connections <= state.wanted:
            start, end = queue.get_nowait()
            if queue.empty():
                state.drained.set()
            while start < end:
                try:
                    written = await self._get_range(
                        request, located, state, start, end, on_progress
                    )
                except (aiohttp.ClientError, OSError, StalledError, ProtocolError) as exc:
                    covered = _covered_until(state.done, start)
                    if self._progressed(covered - start, end - start):
                        backoff.reset()
                    start = max(start, covered)
                    await self._fetcher._backoff_or_raise(exc, request.label, backoff, None)
                    continue
                except _RetryLater as later:
                    await self._fetcher._backoff_or_raise(
                        later, request.label, backoff, later.after
                    )
                    continue
                if written == 0:
                    await self._fetcher._backoff_or_raise(
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
                    await self._fetcher._backoff_or_raise(
                        ProtocolError(f"short body: {written} of {wanted} bytes"),
                        request.label,
                        backoff,
                        None,
                    )

    def _progressed(self, delivered: int, wanted: int) -> bool:
        """Progress that earns a fresh retry budget: the whole range, or one ``read_size``.
        Less must not, or a server that sends a byte per request is never given up on."""
        return delivered > 0 and delivered >= min(wanted, self.config.read_size)

    async def _get_range(
        self,
        request: BlobRequest,
        located: Located,
        state: _FileState,
        start: int,
        end: int,
        on_progress: ProgressFn,
    ) -> int:
        """One Range request for [start, end); returns the bytes written (may be short)."""
        headers = dict(located.headers)
        whole = state.single_stream and start == 0 and end == state.size
        if not whole:
            headers["Range"] = format_range(start, end - 1)
            if state.etag is not None:
                headers[request.validator] = state.etag
            if state.wire is not None and not state.unframed:
                received = await self._get_range_wire(
                    request, located.url, headers, state, start, end, on_progress
                )
                if received is not None:
                    return received
        async with self._fetcher._request("GET", located.url, headers) as resp:
            if resp.status == 200 and whole:
                if resp.content_length is not None and resp.content_length != state.size:
                    raise ProtocolError(
                        f"{request.label}: full body of {resp.content_length} bytes, "
                        f"expected {state.size}"
                    )
            elif resp.status in (200, 206, 416):
                _check_range_answer(resp.status, resp.headers.get, request.label, state, start, end)
            else:
                await self._fetcher._raise_for_status(resp, request.label, relocatable=True)
            _check_encoding(resp.headers.get, request.label)
            return await self._stream_body(resp, state, start, end, on_progress)

    async def _get_range_wire(
        self,
        request: BlobRequest,
        url: str,
        headers: Mapping[str, str],
        state: _FileState,
        start: int,
        end: int,
        on_progress: ProgressFn,
    ) -> int | None:
        """``_get_range`` with the body read by the file's pump and written to the file.

        A worker thread sends the request, reads the head, checks it as the aiohttp path
        does (``_check_range_answer``) and hands an answer that passes to the pump itself: a
        body never waits in socket buffers for the event loop's turn (a ``kill -9`` would
        lose what waits there). None: an answer only the aiohttp path reads (a redirect, a
        body without a length); it asks again. Every other answer means what it means there.
        Bytes count as on disk the moment their ``pwrite`` returns (they are in the page
        cache), reported every ``write_size``.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        wire = state.wire
        assert wire is not None

        def landed(first: int, stop: int) -> None:
            n = stop - first
            state.downloaded += n
            self._fetcher._bytes += n
            on_progress(n)
            state.on_disk(first, stop)

        def report(first: int, stop: int) -> None:
            state.keeper.landed(first, stop)
            loop.call_soon_threadsafe(landed, first, stop)

        watchdog = _Watchdog(self._clock, cfg)

        def begin() -> _Begun:
            stream = wire.reader.open(url, self._fetcher._headers(url, headers))
            head = stream.head
            if head.status not in (200, 206, 416) or not stream.framed:
                return _Begun(stream, None)
            try:
                _check_range_answer(head.status, head.get, request.label, state, start, end)
                _check_encoding(head.get, request.label)
            except BaseException:
                stream.close()
                raise
            return _Begun(stream, wire.pump.receive(stream, start, end, report, watchdog.count))

        self._fetcher._active += 1
        try:
            opening = state.start_in_thread(begin, executor=wire.threads)
            try:
                begun = await asyncio.shield(opening)
            except asyncio.CancelledError:
                opening.add_done_callback(partial(_abandon, state, wire.pump))
                raise
            stream = begun.stream
            try:
                if begun.body is not None:
                    return await self._await_body(state, wire.pump, stream, begun.body)
                head = stream.head
                if head.status in (200, 206, 416):
                    state.unframed = True  # a body without a length: the aiohttp path reads
                    return None  # it, and the file's later ones (no request twice)
                if head.status in _REDIRECTS:
                    return None
                reading = state.start_in_thread(
                    stream.read_small, _ERROR_BODY, executor=wire.threads
                )
                body = await asyncio.shield(reading)
                raise _status_error(head.status, head.get, body, request.label, relocatable=True)
            finally:
                stream.close()
        finally:
            self._fetcher._active -= 1

    @staticmethod
    async def _await_body(
        state: _FileState, pump: Pump, stream: Stream, body: concurrent.futures.Future[int]
    ) -> int:
        future = _track_body(state, body)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            pump.abort(stream)
            raise

    async def _stream_body(
        self,
        resp: aiohttp.ClientResponse,
        state: _FileState,
        start: int,
        end: int,
        on_progress: ProgressFn,
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
        """
        cfg = self.config
        framed = resp.content_length is not None  # aiohttp's parser holds it to that length
        pieces: list[bytes] = []
        pending = 0
        queued = start  # being written before ``queued``
        trusted = claimed = written = start  # framing checked; counted as done; on disk
        writing: asyncio.Future[None] | None = None
        watchdog = _Watchdog(self._clock, cfg)

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
                state.on_disk(first, stop)

            return mark

        async def flush() -> None:
            nonlocal pieces, pending, queued, writing, claimed
            await settle()
            if not pieces and trusted == claimed:
                return
            batch, pieces, pending = pieces, [], 0
            size = sum(len(p) for p in batch)
            writing = state.start_in_thread(_write_landed, state, batch, queued, (claimed, trusted))
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
                piece = piece[:want]
                if not piece:
                    trusted = queued + pending  # a chunk's end, or the body's clean end
                    if chunk_ended:
                        continue
                    break
                if self._throttle is not None and (pause := self._throttle(len(piece))) > 0:
                    await asyncio.sleep(pause)
                pieces.append(piece)
                n = len(piece)
                pending += n
                if framed or chunk_ended:
                    trusted = queued + pending
                state.downloaded += n
                self._fetcher._bytes += n
                on_progress(n)
                if pending >= cfg.write_size:
                    await flush()
                watchdog.count(n)
            if trusted < queued + pending and await _chunk_ends(
                resp, _ERROR_BODY, cfg.read_timeout
            ):
                trusted = queued + pending
        finally:
            await flush()
            await settle()
        return written - start

    # ------------------------------------------------------------------ hashing

    async def _hash(
        self, state: _FileState, request: BlobRequest, store: StoreChecksum | None
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
            got = await state.in_thread(_hash_span, digest, state, hashed, frontier)
            if got < frontier:
                raise ProtocolError("partial file shrank while hashing")
            hashed = got
        return digest

    # ------------------------------------------------------------------ sidecar

    async def _keep_record(self, state: _FileState) -> None:
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
                await state.in_thread(state.keeper.save)


def _proxy_refused(sent: bool | None) -> str:
    """What a 407 means, told whether the request carried the proxy URL's credentials."""
    if sent:
        return "the proxy refused the credentials in the proxy URL (HTTP 407): check them"
    if sent is None:
        return (
            "the proxy wants credentials, or refused the ones given (HTTP 407); they go in the "
            "proxy URL, http://USER:PASS@HOST:PORT"
        )
    return "the proxy wants credentials (HTTP 407): give them in the proxy URL, http://USER:PASS@HOST:PORT"


class _RetryLater(TransferError):
    """A retryable HTTP status, with the server's Retry-After when it sent one."""

    def __init__(self, message: str, *, after: float | None, status: int) -> None:
        super().__init__(message)
        self.after = after
        self.status = status


# ---------------------------------------------------------------------- helpers


def _with_defaults(headers: Mapping[str, str]) -> dict[str, str]:
    merged = {"Accept-Encoding": "identity", "User-Agent": "shardsync/0.1"}
    merged.update(headers)
    return merged


def redact_url(url: str) -> str:
    """A URL fit for messages: no query (signed URLs carry credentials there), no userinfo."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _origin_of(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port


def _follow(url: str, headers: dict[str, str], location: str | None) -> tuple[str, dict[str, str]]:
    """Resolve a redirect; drop credentials when it leaves the origin; refuse https->http."""
    if not location:
        raise ProtocolError(f"redirect without Location from {redact_url(url)}")
    target = urljoin(url, location)
    old, new = _origin_of(url), _origin_of(target)
    if new[0] not in ("http", "https"):
        raise ProtocolError(f"refusing redirect to {new[0]!r} URL")
    if old[0] == "https" and new[0] == "http":
        raise ProtocolError(f"refusing https -> http redirect to {redact_url(target)}")
    if old != new:
        headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIAL_HEADERS}
    return target, headers


def _unquote_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.removeprefix("W/")
    return value.strip('"') or None


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def _read_at_most(resp: aiohttp.ClientResponse, n: int) -> bytes:
    body = bytearray()
    while len(body) < n:
        piece = await resp.content.read(n - len(body))
        if not piece:
            break
        body += piece
    return bytes(body)


def _status_error(
    status: int, header: Header, body: bytes, label: str, *, relocatable: bool
) -> Exception:
    """What a non-success answer means: the error to raise (``_RetryLater`` when a retry may
    help, ``_Relocate`` when a fresh URL may, ``_Restart`` when the object changed)."""
    code = header("X-Error-Code") or ""
    message = _error_message(body)
    detail = (
        f"{label}: HTTP {status}{' ' + code if code else ''}{': ' + message if message else ''}"
    )
    if code == "RepoNotFound":
        return RepoNotFoundError(detail)
    if code == "RevisionNotFound":
        return RevisionNotFoundError(detail)
    if code == "EntryNotFound":
        return EntryNotFoundError(detail)
    if code == "GatedRepo":
        return AuthError(detail)
    if status == 407:
        return AuthError(f"{detail}: {_proxy_refused(None)}")
    verdict = classify_status(status)
    if verdict == "retry":
        after = parse_retry_after(header("Retry-After"), now=time.time())
        return _RetryLater(detail, after=after, status=status)
    if verdict == "restart" and relocatable:
        return _Restart(detail, etag=None, single_stream=False)
    if verdict == "relocate":
        return _Relocate(detail) if relocatable else AuthError(detail)
    if status == 404:
        return EntryNotFoundError(detail)
    return OriginError(detail)


def _check_range_answer(
    status: int, header: Header, label: str, state: _FileState, start: int, end: int
) -> None:
    """Accept a 206 for exactly ``[start, end)`` of the object first seen; a 200 or 416 to a
    Range request means start over (``_Restart``), as does a changed ETag."""
    if status == 200:
        # Range ignored (same object: fall back to one stream) or If-Range failed (a new
        # object: start over with ranges).
        new_etag = header("ETag")
        raise _Restart(
            "200 to a Range request",
            etag=new_etag,
            single_stream=state.etag is None or new_etag == state.etag,
        )
    if status == 416:
        total = parse_unsatisfied_range(header("Content-Range") or "")
        raise _Restart(
            f"416: object is now {total} bytes, expected {state.size}",
            etag=None,
            single_stream=False,
        )
    cr = parse_content_range(header("Content-Range") or "")
    if cr is None or cr.start != start or cr.end >= end or cr.total != state.size:
        raise ProtocolError(
            f"{label}: asked for bytes {start}-{end - 1}/{state.size}, "
            f"got Content-Range {header('Content-Range')!r}"
        )
    etag = header("ETag")
    with state.etag_lock:  # heads are checked on the loop and in wire threads
        if state.etag is not None and etag is not None and etag != state.etag:
            raise _Restart("ETag changed", etag=etag, single_stream=False)
        if state.etag is None and is_strong_etag(etag):
            state.etag = etag


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


def _check_encoding(header: Header, label: str) -> None:
    encoding = (header("Content-Encoding") or "identity").lower()
    if encoding not in ("identity", ""):
        raise ProtocolError(f"{label}: server applied Content-Encoding {encoding}")


def _error_message(body: bytes) -> str:
    """The server's own words about an error (a JSON ``error``, or short plain text), at
    most 300 characters. Redacted first (``errors.redact``): a server may quote the request
    it refused, and that is the signed URL, query, signature and session token all."""

    with contextlib.suppress(ValueError, UnicodeDecodeError):
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
            return redact(str(parsed["error"]))[:300]
    text = body.decode("utf-8", "replace").strip()
    if text and not text.lstrip().startswith("<"):
        return redact(text)[:300]
    return ""


def _malformed(exc: aiohttp.ClientResponseError, label: str) -> ProtocolError:
    """aiohttp's parser refused an answer (two lengths, a length beside chunked, a chunk
    whose size lies): the server broke HTTP, as when the pump refuses one. Its message
    quotes the offending bytes and names the URL, query and all: keep the first line."""
    first_line = exc.message.split("\n", 1)[0].rstrip(":")[:200]
    return ProtocolError(f"{label}: malformed answer: {first_line}")


def _cause(exc: BaseException) -> str:
    if isinstance(exc, _RetryLater):
        return f"http_{exc.status}"
    if isinstance(exc, StalledError):
        return "stalled"
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "connection"


def _describe(exc: BaseException) -> str:
    """The error in a user's words: aiohttp's own text for a refused connection shows its
    connection key (``ssl:default``, even for plain http); say what failed instead. Any
    other text is redacted (``errors.redact``): a library may name the signed URL it failed
    on (``InvalidURL`` is the whole URL), and this text goes into messages and logs."""
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(
        exc, aiohttp.ClientConnectorCertificateError | aiohttp.ClientSSLError
    ):
        what = "the proxy " if isinstance(exc, aiohttp.ClientProxyConnectionError) else ""
        code = exc.os_error.errno
        reason = os.strerror(code) if code and code > 0 else (exc.strerror or str(exc.os_error))
        return f"cannot connect to {what}{exc.host}:{exc.port}: {reason}"

    return redact(str(exc))


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
    for kind in (_Restart, _Relocate, ShardsyncError):
        for e in leaves:
            if isinstance(e, kind):
                raise e
    raise leaves[0]


@dataclass(frozen=True, slots=True)
class _Begun:
    """A request sent on the wire and its head read; ``body``: the pump reads it."""

    stream: Stream
    body: concurrent.futures.Future[int] | None


def _track_body(state: _FileState, body: concurrent.futures.Future[int]) -> asyncio.Future[int]:
    """The pump's reading as a loop future that ``drain`` waits for: the file must stay open
    while the pump writes to it."""
    future = asyncio.wrap_future(body)
    state.in_flight.add(future)
    future.add_done_callback(state.in_flight.discard)
    future.add_done_callback(_mark_retrieved)
    return future


def _abandon(state: _FileState, pump: Pump, opening: asyncio.Future[_Begun]) -> None:
    """A request whose caller was cancelled while it started: stop its body, if the pump
    took one, and let the connection go."""
    if opening.cancelled() or opening.exception() is not None:
        return
    begun = opening.result()
    if begun.body is not None:
        _track_body(state, begun.body)
        pump.abort(begun.stream)
    begun.stream.close()


def _hash_span(digest: Digest, state: _FileState, start: int, end: int) -> int:
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


async def _to_the_end(cleanup: Coroutine[Any, Any, None]) -> None:
    """Run ``cleanup`` to its end even when the caller is cancelled meanwhile, then raise the
    cancellation. A cleanup stopped halfway (a second cancel during a first one's cleanup, as
    a task group's abort and its parent's can give) left the file's pump thread, its sockets
    and the partial's descriptor open for the life of the process."""
    task = asyncio.ensure_future(cleanup)
    cancelled = False
    while True:
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return


def _close_transfer(state: _FileState) -> None:
    """Close the file's wire and the hasher's window once no thread uses them."""
    if state.wire is not None:
        state.wire.close()
        state.wire = None
    if state.pages is not None:
        state.pages.close()
        state.pages = None


def _resumable(request: BlobRequest, state: _FileState) -> Resumable | None:
    """What the resume record binds the partial to; None without a strong ETag (yet)."""
    if state.etag is None:
        return None
    return Resumable(request.url, state.etag, state.size, request.sha256)


def _write_landed(
    state: _FileState, batch: list[bytes], first: int, claim: tuple[int, int]
) -> None:
    """Write ``batch`` at ``first`` in a worker thread and tell the resume record at once
    that bytes ``claim`` (written by now, by this batch or the ones before it) are done."""
    write_all(state.fd, batch, first)
    if claim[1] > claim[0]:
        state.keeper.landed(*claim)
