"""Body transfers off the event loop: HTTP/1.1 Range responses read straight into the file.

The event loop is one thread; at GPU-host line rates it cannot also move every body byte
through Python objects (aiohttp hands each socket read over as a new ``bytes``, joined,
written with ``pwritev`` and read back again to hash). Here worker threads send each request
and read its head (``RangeReader``), and one thread per file (``Pump``) reads the bodies of
all its connections with ``recv_into`` into one reused buffer and ``pwrite``s each read at
its offset: the buffer stays in the CPU's cache, and the page cache's pages are filled by a
plain copy. The hasher then reads those pages in place (``digest.MappedFile``).
``recv_into``, ``pwrite`` and ``sha256`` release the GIL, so the files' transfers and hashes
run on separate cores.

Only the happy path lives here: a plain HTTP/1.1 response whose body length is known, and
only one length (a second, or one beside ``Transfer-Encoding``, is refused). The fetcher
decides what every other answer means (the same code as for aiohttp's), and sends requests
through a proxy down the aiohttp path.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shardsync.errors import ConfigError, ProtocolError, disk_error

__all__ = [
    "BodyTruncated",
    "Head",
    "Pump",
    "RangeReader",
    "Stream",
    "write_all",
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


_IOV_MAX = 512  # pieces per pwritev call, well under the kernel's IOV_MAX (1024)


def write_all(fd: int, pieces: Sequence[bytes | memoryview], offset: int) -> None:
    """Write ``pieces`` back to back at ``offset`` (``pwritev``), retrying short writes: a
    write cut short by a full disk is followed by one that fails with ENOSPC."""
    views = [memoryview(p) for p in pieces if p]
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of dirty pages in the range; do not wait
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)  # Linux only
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    _sync_file_range.restype = ctypes.c_int


def start_writeback(fd: int, start: int, end: int) -> None:
    """Have the kernel start writing bytes ``[start, end)`` of ``fd`` to disk now, without
    waiting (``sync_file_range``). The fsync before publishing then finds little left to
    do; without this a download smaller than the dirty-page threshold (10% of RAM by
    default: many GB on a GPU host) reaches the disk only in that fsync. Best effort: where
    the call is missing or refused, the fsync does it all, as before."""
    if _sync_file_range is not None and end > start:
        _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)


@dataclass(frozen=True, slots=True)
class Head:
    """Status line and headers of a response; header names lowercased, repeats joined."""

    status: int
    headers: Mapping[str, str]
    version: str

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


_Key = tuple[str, str, int]


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

    def open(self, url: str, headers: Mapping[str, str]) -> Stream:
        """Send a GET and read the response head (blocking; call it in a worker thread).

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
        pooled = self._take(key)
        if pooled is not None:
            try:
                return self._exchange(pooled, key, request)
            except (BodyTruncated, ConnectionResetError, BrokenPipeError):
                pass  # closed while idle: nothing was answered, so asking again is safe
        return self._exchange(self._connect(key), key, request)

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

    def _give_back(self, key: _Key, sock: socket.socket) -> None:
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

    def _exchange(self, sock: socket.socket, key: _Key, request: bytes) -> Stream:
        try:
            sock.sendall(request)
            head, rest = _read_head(sock)
            return Stream(self, key, sock, head, rest)
        except BaseException:
            sock.close()
            raise


def _read_head(sock: socket.socket) -> tuple[Head, bytes]:
    data = b""
    while True:
        end = data.find(b"\r\n\r\n")
        if end > _MAX_HEAD or (end < 0 and len(data) > _MAX_HEAD):
            raise ProtocolError(f"response head over {_MAX_HEAD} bytes")
        if end >= 0:
            break
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
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or len(code) != 3:
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
        self.length = int(length) if length is not None and length.isdigit() else None
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

    def _take(self) -> socket.socket | None:
        """For the pump: the socket, non-blocking, until ``_release``."""
        with self._guard:
            self._pumping = True
        sock = self._sock
        if sock is not None:
            sock.setblocking(False)
        return sock

    def _release(self, read_timeout: float) -> None:
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
            self._reader._give_back(self._key, sock)
        else:
            sock.close()


Landed = Callable[[int, int], None]
"""Told ``(first, stop)``: body bytes now written to the file (called on the pump's thread)."""

Meter = Callable[[int], None]
"""Told each read's size; raises to give up on the transfer (a throughput watchdog)."""


@dataclass(eq=False, slots=True)
class _Transfer:
    stream: Stream
    sock: socket.socket
    start: int
    pos: int
    end: int
    landed: Landed
    meter: Meter
    done: Future[int]
    last: float
    reported: int = field(init=False)
    lowat: int = 1
    began: float = field(init=False)
    recent: float | None = None  # bytes/s of the last few reads
    rate: float | None = None  # bytes/s to size wake-ups by (``_track_rate``)

    def __post_init__(self) -> None:
        self.reported = self.pos
        self.began = self.last


_WAKE_EVERY = 0.005
"""Seconds of a connection's data to let gather in the kernel before its socket counts as
readable (``SO_RCVLOWAT``): one wake-up per few hundred KiB instead of per packet. With 64
connections it cut the CPU per GB by about 15%; a ``kill -9`` loses at most this much more."""
_WAKE_AT_MOST = 1 << 20
_WARM_UP = 0.02  # seconds of a transfer before its rate means anything


def _track_rate(t: _Transfer, n: int, previous: float, now: float) -> None:
    """The rate to size wake-ups by: the lower of the bytes per second of the last few reads
    (each counts half) and the average since the request began.

    A sender that sends in bursts (nginx's ``limit_rate`` sends a new request's first second
    at once, then as much as its socket buffer takes at a time) looks fast read by read and
    slow on average; a wake-up sized to the bursts (up to 1 MiB) strands what is left of each
    in the kernel until the next one, 0.3-2 MB per connection at a kill. The lower rate wakes
    more often, and strands at most ``_WAKE_EVERY`` of the average."""
    if now - t.began < _WARM_UP:
        return
    recent = n / max(now - previous, 1e-4)
    t.recent = recent if t.recent is None else 0.5 * (t.recent + recent)
    t.rate = min(t.recent, (t.pos - t.start) / (now - t.began))


def _set_lowat(t: _Transfer, rate: float | None) -> None:
    """Wake for ``_WAKE_EVERY`` of data at ``rate``, never for more than the body has left
    (else its last bytes would never count as readable). Otherwise changed only when off by
    a fifth or a quarter: each change is a system call."""
    left = t.end - t.pos - t.stream.buffered_bytes()
    want = max(1, min(_WAKE_AT_MOST, int((rate or 0.0) * _WAKE_EVERY), left))
    if left < t.lowat or not 0.8 * t.lowat <= want <= 1.25 * t.lowat:
        with contextlib.suppress(OSError):  # a platform without it: one wake-up per packet
            t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
        t.lowat = want


class Pump:
    """One file's bodies, read by one thread that serves all its connections.

    A thread per connection would leave dozens of threads contending for two cores and the
    GIL; bytes then wait in socket buffers, and a ``kill -9`` loses them. One thread per
    file waits on all its sockets at once and reads whichever has data into its buffer, then
    writes it to the file (``fd``) at once, reporting every ``report_size`` bytes.

    Writing through a shared mapping of the file instead saves that copy but costs more:
    each page is zeroed when its blocks are reserved (without the reservation a full disk
    is a SIGBUS) and then faulted in. On the capped 2 GB benchmark that was 0.2 CPU-s/GB
    more and 0.1-0.3 s slower.
    """

    def __init__(
        self,
        fd: int,
        *,
        read_size: int,
        report_size: int,
        read_timeout: float,
        clock: Callable[[], float],
        throttle: Callable[[int], float] | None = None,
    ) -> None:
        self._fd = fd
        # reused, so it stays in the CPU's cache; mapped, so its pages are zeroed as first
        # touched: a bytearray's memset faulted in all of it before the file's first request
        self._memory = mmap.mmap(-1, read_size)
        self._buffer = memoryview(self._memory)
        self._report_size = report_size
        self._read_timeout = read_timeout
        self._clock = clock
        self._throttle = throttle
        self._lock = threading.Lock()
        self._incoming: list[_Transfer] = []
        self._aborted: list[Stream] = []
        self._closing = False
        self.received = 0
        """Body bytes read so far, all transfers together (written by the pump's thread)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread: threading.Thread | None = None

    def receive(
        self, stream: Stream, start: int, end: int, landed: Landed, meter: Meter
    ) -> Future[int]:
        """Write ``stream``'s body to bytes ``[start, end)`` of the file; the future gets
        the bytes read (fewer when the body ends short) or the error that stopped it.
        ``landed`` hears every stretch as it lands."""
        done: Future[int] = Future()
        sock = stream._take()
        if sock is None:
            stream._release(self._read_timeout)
            done.set_exception(BodyTruncated("the connection is closed"))
            return done
        transfer = _Transfer(stream, sock, start, start, end, landed, meter, done, self._clock())
        with self._lock:
            if self._closing:
                raise RuntimeError("the pump is closed")
            self._incoming.append(transfer)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="shardsync-pump", daemon=True
                )
                self._thread.start()
        self._wake()
        return done

    def abort(self, stream: Stream) -> None:
        """Stop reading ``stream``: its future fails soon after, and the socket is let go."""
        with self._lock:
            self._aborted.append(stream)
        self._wake()

    def close(self) -> None:
        """Stop the thread; transfers still running fail (call it after they ended)."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join()
        self._wake_r.close()
        self._wake_w.close()
        self._buffer.release()
        self._memory.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        active: dict[int, _Transfer] = {}
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ, None)
            while True:
                with self._lock:
                    incoming, self._incoming = self._incoming, []
                    aborted, self._aborted = self._aborted, []
                    closing = self._closing
                for t in incoming:
                    active[t.sock.fileno()] = t
                    selector.register(t.sock, selectors.EVENT_READ, t)
                    if t.stream.exhausted:  # an empty body: nothing will ever be readable
                        self._finish(active, selector, t, None)
                for stream in aborted:
                    for t in [t for t in active.values() if t.stream is stream]:
                        stopped = BodyTruncated("the transfer was stopped")
                        self._finish(active, selector, t, stopped)
                if closing:
                    for t in list(active.values()):
                        self._finish(active, selector, t, BodyTruncated("the pump closed"))
                    return
                ready = [t for t in active.values() if t.stream.buffered()]
                timeout = 0.0 if ready else min(1.0, self._read_timeout)
                for key, _ in selector.select(timeout):
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError, OSError):
                            self._wake_r.recv(4096)
                    elif key.data not in ready:
                        ready.append(key.data)
                for t in ready:
                    self._read(active, selector, t)
                now = self._clock()
                for t in list(active.values()):
                    if now - t.last > self._read_timeout:
                        late = TimeoutError(f"no body bytes for {self._read_timeout:.0f} s")
                        self._finish(active, selector, t, late)

    def _read(
        self, active: dict[int, _Transfer], selector: selectors.BaseSelector, t: _Transfer
    ) -> None:
        try:
            with self._buffer[: t.end - t.pos] as target:
                n = t.stream.readinto(target)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except BaseException as exc:
            self._finish(active, selector, t, exc)
            return
        try:
            with self._buffer[:n] as received:
                write_all(self._fd, [received], t.pos)
        except OSError as exc:
            self._finish(active, selector, t, disk_error(exc, "write the partial file"))
            return
        t.pos += n
        previous, t.last = t.last, self._clock()
        self.received += n
        _track_rate(t, n, previous, t.last)
        try:
            if self._throttle is not None and (pause := self._throttle(n)) > 0:
                time.sleep(pause)  # a bandwidth cap: this file's connections all wait
            if t.pos - t.reported >= self._report_size:
                t.landed(t.reported, t.pos)
                t.reported = t.pos
            t.meter(n)
        except BaseException as exc:
            self._finish(active, selector, t, exc)
            return
        if t.pos >= t.end or t.stream.exhausted:
            self._finish(active, selector, t, None)  # short: the fetcher asks for the rest
        else:
            _set_lowat(t, t.rate)

    def _finish(
        self,
        active: dict[int, _Transfer],
        selector: selectors.BaseSelector,
        t: _Transfer,
        error: BaseException | None,
    ) -> None:
        active.pop(t.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            selector.unregister(t.sock)
        if t.lowat != 1:
            with contextlib.suppress(OSError):
                t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            t.lowat = 1
        if t.pos > t.reported:
            with contextlib.suppress(Exception):
                t.landed(t.reported, t.pos)
            t.reported = t.pos
        if error is not None:
            t.stream.abort()  # what is left of the body is not read: never reuse it
        t.stream._release(self._read_timeout)
        if error is None:
            t.done.set_result(t.pos - t.start)
        else:
            t.done.set_exception(error)
