"""HTTP/1.1 Range responses on our own sockets, for the pump to read (``fetch.pump``).

The event loop is one thread; at GPU-host line rates it cannot also move every body byte
through Python objects (aiohttp hands each socket read over as a new ``bytes``, joined,
written with ``pwritev`` and read back again to hash). Here worker threads send each request
and read its head (``RangeReader``), keeping connections alive per host; a ``Stream`` is one
response, whose body the file's pump reads straight into the file.

Only the happy path lives here: a plain HTTP/1.1 response whose body length is known, and
only one length (a second, or one beside ``Transfer-Encoding``, is refused). What every
answer means is decided in ``fetch.answers`` (the same code as for aiohttp's), and requests
through a proxy take the aiohttp path (``fetch.body_aiohttp``).
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from shardsync.errors import ConfigError, ProtocolError

__all__ = [
    "BodyTruncated",
    "Head",
    "Opening",
    "RangeReader",
    "Stream",
]

_MAX_HEAD = 64 * 1024
_MAX_HEADERS = 200
_IDLE_PER_HOST = 32


_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field name
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # CR, LF, NUL...: request splitting
_TARGET_SAFE = frozenset(range(0x21, 0x7F))


def _quote_target(target: str) -> str:
    """The request target as the request line may carry it: any byte that is not visible
    ASCII (a space, CR/LF from a hostile redirect, non-ASCII) is percent-encoded, so no
    ``Location`` can split the request or add a header."""
    raw = target.encode("utf-8", "surrogateescape")
    if all(b in _TARGET_SAFE for b in raw):
        return target
    return "".join(chr(b) if b in _TARGET_SAFE else f"%{b:02X}" for b in raw)


class BodyTruncated(ConnectionError):
    """The server closed the connection before the body's last byte (retryable)."""


@dataclass(frozen=True, slots=True)
class Head:
    """Status line and headers of a response; header names lowercased, repeats joined."""

    status: int
    headers: Mapping[str, str]
    version: str

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


_Key = tuple[str, str, int]


class Opening:
    """A request being sent and its head read in a worker thread, which a cancel on the
    loop stops (``abort``): the thread would otherwise block in ``recv`` until the head's
    deadline, and the file's descriptor is held open until it returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._aborted = False

    def hold(self, sock: socket.socket | None) -> None:
        """The socket the thread now blocks on (None: it is done with sockets)."""
        with self._lock:
            if self._aborted and sock is not None:
                raise BodyTruncated("the request was stopped")
            self._sock = sock

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class RangeReader:
    """Keep-alive HTTP/1.1 connections for body transfers, used from worker threads."""

    def __init__(
        self, ssl_context: ssl.SSLContext | None, *, connect_timeout: float, read_timeout: float
    ) -> None:
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._idle: dict[_Key, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def open(self, url: str, headers: Mapping[str, str], opening: Opening | None = None) -> Stream:
        """Send a GET and read the response head (blocking; call it in a worker thread;
        ``opening.abort()`` stops it from another).

        A pooled connection the server has closed meanwhile fails before any answer byte;
        then the request goes once more on a fresh connection, as browsers do.
        """
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ProtocolError(f"cannot fetch {parts.scheme!r} URLs")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        key: _Key = (parts.scheme, parts.hostname, port)
        target = _quote_target((parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
        name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        host = name if port == (443 if parts.scheme == "https" else 80) else f"{name}:{port}"
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}"]
        for field_name, value in headers.items():
            if field_name.lower() == "host":
                continue
            if not _TOKEN.fullmatch(field_name) or _UNSAFE_VALUE.search(value):
                raise ConfigError(f"header {field_name[:50]!r} is not a valid HTTP field")
            lines.append(f"{field_name}: {value}")
        try:
            request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        except UnicodeEncodeError as exc:
            raise ConfigError("a request header is not Latin-1 text") from exc
        opening = opening or Opening()
        pooled = self._take(key)
        if pooled is not None:
            try:
                return self._exchange(pooled, key, request, opening)
            except (BodyTruncated, ConnectionResetError, BrokenPipeError):
                pass  # closed while idle: nothing was answered, so asking again is safe
        return self._exchange(self._connect(key), key, request, opening)

    def close(self) -> None:
        """Close the idle connections (transfers in flight close their own)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _take(self, key: _Key) -> socket.socket | None:
        with self._lock:
            socks = self._idle.get(key)
            return socks.pop() if socks else None

    def give_back(self, key: _Key, sock: socket.socket) -> None:
        """Keep a connection whose answer was read to its end for the next request (a
        ``Stream`` hands its socket back here when it closes)."""
        with self._lock:
            socks = self._idle.setdefault(key, [])
            if len(socks) < _IDLE_PER_HOST:
                socks.append(sock)
                return
        sock.close()

    def _connect(self, key: _Key) -> socket.socket:
        scheme, hostname, port = key
        sock = socket.create_connection((hostname, port), timeout=self._connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                if self._ssl is None:
                    raise ProtocolError("an https URL without a TLS context")
                sock = self._ssl.wrap_socket(sock, server_hostname=hostname)
            sock.settimeout(self._read_timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def _exchange(self, sock: socket.socket, key: _Key, request: bytes, opening: Opening) -> Stream:
        try:
            opening.hold(sock)
            sock.sendall(request)
            head, rest = _read_head(sock, self._read_timeout)
            sock.settimeout(self._read_timeout)
            return Stream(self, key, sock, head, rest)
        except BaseException:
            sock.close()
            raise
        finally:
            opening.hold(None)  # the stream's own ``abort`` stops it from now on


def _read_head(sock: socket.socket, timeout: float) -> tuple[Head, bytes]:
    """The head and what came after it, in ``timeout`` seconds all told: a server that
    drips it a byte at a time would get a full read timeout per byte."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end > _MAX_HEAD or (end < 0 and len(data) > _MAX_HEAD):
            raise ProtocolError(f"response head over {_MAX_HEAD} bytes")
        if end >= 0:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no complete response head in {timeout:.0f} s")
        sock.settimeout(left)
        more = sock.recv(65536)
        if not more:
            raise BodyTruncated("the connection closed before a response")
        data += more
    return _parse_head(data[:end]), data[end + 4 :]


def _parse_head(raw: bytes) -> Head:
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError as exc:  # latin-1 decodes every byte; kept for clarity
        raise ProtocolError("response head is not text") from exc
    status_line, *header_lines = text.split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not _is_digits(code) or len(code) != 3:
        raise ProtocolError(f"malformed status line {status_line[:100]!r}")
    if len(header_lines) > _MAX_HEADERS:
        raise ProtocolError(f"more than {_MAX_HEADERS} response headers")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise ProtocolError(f"malformed response header {line[:100]!r}")
        lower, value = name.lower(), value.strip(" \t")
        headers[lower] = f"{headers[lower]}, {value}" if lower in headers else value
    return Head(status=int(code), headers=headers, version=version)


class Stream:
    """One response: its head, then its body read into caller memory."""

    def __init__(
        self, reader: RangeReader, key: _Key, sock: socket.socket, head: Head, rest: bytes
    ) -> None:
        self.head = head
        self._reader = reader
        self._key = key
        self._sock: socket.socket | None = sock
        self._rest = rest
        self._aborted = threading.Event()
        self._guard = threading.Lock()
        self._pumping = False  # a pump owns the socket: ``close`` waits for it to let go
        self._close_asked = False
        length = head.get("content-length")
        if length is not None and ("," in length or head.get("transfer-encoding") is not None):
            # two lengths, or a length beside Transfer-Encoding (RFC 9112 6.3: the encoding
            # wins, and such an answer is the classic smuggling vector): never trusted
            raise ProtocolError(f"conflicting body framing: Content-Length {length[:40]!r}")
        if length is not None and len(length) > 19:  # past 2**63 (and Python's int limit)
            raise ProtocolError(f"Content-Length of {len(length)} characters")
        self.length = int(length) if length is not None and _is_digits(length) else None
        self._left = self.length

    @property
    def framed(self) -> bool:
        """The body ends by its Content-Length: the only framing read here."""
        return self.length is not None

    def readinto(self, view: memoryview) -> int:
        """Up to ``len(view)`` body bytes into ``view``; 0 at the end of the body."""
        return self._read_into(view)

    def _read_into(self, view: memoryview) -> int:
        if self._left is None:
            raise ProtocolError("a body without Content-Length is not read here")
        want = min(len(view), self._left)
        if want == 0:
            return 0
        if self._rest:
            n = min(want, len(self._rest))
            view[:n] = self._rest[:n]
            self._rest = self._rest[n:]
        else:
            sock = self._sock
            if sock is None or self._aborted.is_set():
                raise BodyTruncated("the transfer was stopped")
            with view[:want] as target:
                n = sock.recv_into(target)
            if n == 0:
                raise BodyTruncated(f"the connection closed with {self._left} body bytes to come")
        self._left -= n
        return n

    def read_small(self, cap: int) -> bytes:
        """The start of a short body (an error's message); the connection is then closed."""
        if not self.framed or self.length is None or self.length > cap:
            return b""
        buffer = bytearray(self.length)
        with memoryview(buffer) as view:
            got = 0
            with contextlib.suppress(OSError):
                while got < len(buffer):
                    n = self._read_into(view[got:])
                    if n == 0:
                        break
                    got += n
        return bytes(buffer[:got])

    @property
    def remaining(self) -> int | None:
        """Body bytes not yet read (None: no length), however many were asked for."""
        return self._left

    @property
    def exhausted(self) -> bool:
        """Every byte the body announced has been read."""
        return self._left == 0

    def buffered_bytes(self) -> int:
        """Body bytes already read off the socket (with the head, or decrypted by TLS): a
        readiness check on the socket would not show them, and they will not arrive on it."""
        sock = self._sock
        pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
        return len(self._rest) + pending

    def buffered(self) -> bool:
        """Whether ``buffered_bytes`` holds any."""
        return self.buffered_bytes() > 0

    def abort(self) -> None:
        """Stop the transfer: a blocked ``readinto`` raises, the connection is not reused."""
        self._aborted.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hand a fully read keep-alive connection back to the pool; close any other. While
        a pump still reads it, the pump does this when it lets go."""
        with self._guard:
            if self._pumping:
                self._close_asked = True
                return
        self._close()

    def take_socket(self) -> socket.socket | None:
        """For the pump: the socket, non-blocking, until ``release_socket``."""
        with self._guard:
            self._pumping = True
        sock = self._sock
        if sock is not None:
            sock.setblocking(False)
        return sock

    def release_socket(self, read_timeout: float) -> None:
        """For the pump: done with the socket, which blocks again (``read_timeout``); a
        ``close`` asked meanwhile happens now."""
        with self._guard:
            self._pumping = False
            close = self._close_asked
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(read_timeout)
        if close:
            self._close()

    def _close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        reusable = (
            self._left == 0
            and not self._rest
            and not self._aborted.is_set()
            and self.framed
            and self.head.version == "HTTP/1.1"
            and "close" not in (self.head.get("connection") or "").lower()
        )
        if reusable:
            self._reader.give_back(self._key, sock)
        else:
            sock.close()


def _is_digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` takes "\u00b2" (a latin-1 byte), which ``int`` refuses."""
    return text.isascii() and text.isdigit()
