"""A byte-for-byte HTTP relay on loopback: a forward proxy, or a gateway in front of one
server, that passes every answer on as the server framed it.

A real proxy such as squid repairs what it relays (it re-frames bodies and drops conflicting
lengths), so a lying server behind it never tries the client's own checks. This relay does
not: put it between a client and a hostile server and the client's proxied body path (for
shardsync, aiohttp's) meets the same lies as its direct one. It can also edit each answer's
head (``edit_head``: strip an ``ETag`` from 206 answers, say) and each request's before it
goes on (``edit_request``: move or drop a ``Range``, as a buggy cache does), send each body
chunked (``chunked``: a gateway of generated content), hold each answer's body to ``rate``
bytes a second (a slow link, to stop a client partway), and records every exchange and how
many body bytes it carried (``body_bytes``).

One request per connection (every answer goes on with ``Connection: close``), plain HTTP
only (no ``CONNECT``), request bodies framed by ``Content-Length`` (``Expect: 100-continue``
is answered by the relay itself)::

    async with Relay() as proxy:  # a forward proxy
        config = replace(config, network=network_from_env({"http_proxy": proxy.url}))
        await prefetch(source, config)
        assert proxy.statuses("GET")
    strip = without_fields("ETag", status=206)  # a gateway that drops 206s' ETags
    with serve_in_thread(Relay(upstream=s3_endpoint, edit_head=strip)) as gateway:
        run_s3_job(endpoint=gateway.url)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

__all__ = ["Fields", "HeadEdit", "Relay", "Relayed", "RequestEdit", "without_fields"]

_MAX_HEAD = 64 * 1024
_PIECE = 256 * 1024
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"}
)

Fields = list[tuple[str, str]]
HeadEdit = Callable[[str, int, Fields], Fields]
"""Told the request's method, the answer's status and its header fields (in order, as sent),
returns the fields to send on instead."""
RequestEdit = Callable[[str, str, Fields], Fields]
"""Told the request's method, its target as sent (path and query) and its header fields
(hop-by-hop ones left out), returns the fields to send to the server instead."""


@dataclass(frozen=True, slots=True)
class Relayed:
    """One exchange the relay carried: the request's method and absolute URL, the status
    the server answered (0: none came) and the request's header fields as received."""

    method: str
    url: str
    status: int
    request_fields: tuple[tuple[str, str], ...]


class Relay:
    """See the module docstring. ``upstream``: the server every request goes to (a
    gateway); without it the relay is a forward proxy taking absolute-form requests.
    ``rate``: body bytes a second per exchange (0: as fast as they come); may be changed
    while the relay runs, and each exchange follows the value at its next piece.
    ``chunked``: a body the server framed by its ``Content-Length`` goes on chunked, without
    it (HEAD answers keep theirs)."""

    def __init__(
        self,
        *,
        upstream: str | None = None,
        edit_head: HeadEdit | None = None,
        edit_request: RequestEdit | None = None,
        chunked: bool = False,
        rate: float = 0.0,
    ) -> None:
        if upstream is not None:
            parts = urlsplit(upstream)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"the relay speaks plain http only, not {upstream!r}")
        self._upstream = upstream
        self._edit = edit_head
        self._edit_request = edit_request
        self._chunked = chunked
        self._server: asyncio.Server | None = None
        self._lock = threading.Lock()
        self._log: list[Relayed] = []
        self._body_bytes = 0
        self.rate = rate
        self._serving: set[asyncio.Task[None]] = set()
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._serving):  # exchanges in flight end now
                task.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def log(self) -> tuple[Relayed, ...]:
        """Every exchange so far, oldest first (thread-safe)."""
        with self._lock:
            return tuple(self._log)

    @property
    def body_bytes(self) -> int:
        """Answer body bytes handed to clients so far, every exchange's (thread-safe)."""
        with self._lock:
            return self._body_bytes

    def statuses(self, method: str = "GET") -> list[int]:
        """The statuses of the `method` requests relayed so far."""
        return [r.status for r in self.log if r.method == method]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)
        try:
            await self._relay_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # either side hung up: what it got is what it gets
        except asyncio.CancelledError:
            pass  # the relay is closing
        finally:
            writer.close()

    async def _relay_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        line, fields = _split_head(head)
        method, target, _version = line.split(" ", 2)
        url = self._upstream.rstrip("/") + target if self._upstream is not None else target
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            writer.write(b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\n\r\n")
            return
        length = int(_field(fields, "content-length") or 0)
        if (_field(fields, "expect") or "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the body, then, comes to us
            fields = [(n, v) for n, v in fields if n.lower() != "expect"]
        body = await reader.readexactly(length) if length else b""
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        sent = [(n, v) for n, v in fields if n.lower() not in _HOP_BY_HOP]
        if self._edit_request is not None:
            sent = self._edit_request(method, target, sent)
        up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        status = 0
        try:
            out = [
                f"{method} {path} HTTP/1.1",
                *(f"{n}: {v}" for n, v in sent),
                "Connection: close",
            ]
            up_writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1"))
            up_writer.write(body)
            await up_writer.drain()
            while True:  # interim 1xx answers go on as they are
                answer = await up_reader.readuntil(b"\r\n\r\n")
                status_line, answer_fields = _split_head(answer)
                status = int(status_line.split(" ", 2)[1])
                if status >= 200:
                    break
                writer.write(answer)
            if self._edit is not None:
                answer_fields = self._edit(method, status, answer_fields)
            kept = [(n, v) for n, v in answer_fields if n.lower() != "connection"]
            chunk = (
                self._chunked and method != "HEAD" and _field(kept, "content-length") is not None
            )
            if chunk:
                kept = [(n, v) for n, v in kept if n.lower() != "content-length"]
                kept.append(("Transfer-Encoding", "chunked"))
            lines = [status_line, *(f"{n}: {v}" for n, v in kept), "Connection: close"]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            await self._send_body(up_reader, writer, chunk)
        finally:
            with self._lock:
                self._log.append(Relayed(method, url, status, tuple(fields)))
            up_writer.close()

    async def _send_body(
        self, source: asyncio.StreamReader, writer: asyncio.StreamWriter, chunked: bool
    ) -> None:
        """Pass the answer's body on as it comes (each piece a chunk, if ``chunked``), at most
        ``rate`` bytes a second."""
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), 0
        while True:
            rate = self.rate
            # paced in pieces of about 20 ms, so a paced answer can be stopped near any byte
            piece = await source.read(max(4096, min(_PIECE, int(rate / 50))) if rate else _PIECE)
            if not piece:
                break
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            sent += len(piece)
            with self._lock:
                self._body_bytes += len(piece)
            if rate:
                await asyncio.sleep(max(0.0, started + sent / rate - loop.time()))
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()


def _split_head(head: bytes) -> tuple[str, Fields]:
    if len(head) > _MAX_HEAD:
        raise ConnectionError("a head too large to relay")
    first, *rest = head[:-4].decode("latin-1").split("\r\n")
    fields = []
    for text in rest:
        name, _, value = text.partition(":")
        fields.append((name, value.strip()))
    return first, fields


def _field(fields: Sequence[tuple[str, str]], name: str) -> str | None:
    for n, v in fields:
        if n.lower() == name:
            return v
    return None


def without_fields(*names: str, status: int | None = None) -> HeadEdit:
    """A ``HeadEdit`` dropping the named fields (from `status` answers only, if given)."""
    lowered = {n.lower() for n in names}

    def edit(method: str, answered: int, fields: Fields) -> Fields:
        if status is not None and answered != status:
            return fields
        return [(n, v) for n, v in fields if n.lower() not in lowered]

    return edit
