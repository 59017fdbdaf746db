"""One file's bodies read off the event loop, by one thread for all its connections.

The pump reads every body with ``recv_into`` into one reused buffer and ``pwrite``s each
read at its offset: the buffer stays in the CPU's cache, and the page cache's pages are
filled by a plain copy. The hasher then reads those pages in place (``digest.MappedFile``).
``recv_into``, ``pwrite`` and ``sha256`` release the GIL, so the files' transfers and hashes
run on separate cores. The responses come from ``fetch.wire``; ``fetch.body_wire`` decides
which to hand over.
"""

from __future__ import annotations

import contextlib
import mmap
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from shardsync.errors import disk_error
from shardsync.fetch.disk import write_all
from shardsync.fetch.wire import BodyTruncated, Stream

__all__ = ["Landed", "Meter", "Pump"]


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
    (else its last bytes would never count as readable): a short 206's body ends before the
    asked ``end``. Otherwise changed only when off by a fifth or a quarter: each change is a
    system call."""
    body = t.stream.remaining
    left = min(t.end - t.pos, t.end if body is None else body) - t.stream.buffered_bytes()
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
        self.held = 0.0
        """Seconds the throttle has held the reads (``_hold``): no connection's silence."""
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
        sock = stream.take_socket()
        if sock is None:
            stream.release_socket(self._read_timeout)
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
            if self._throttle is not None and self._hold(n):
                # no transfer was read while held: their silence starts now
                for other in active.values():
                    other.last = self._clock()
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

    def _hold(self, n: int) -> bool:
        """Pause as long as the throttle says (this file's connections all wait), asking it
        again after each pause; an abort or the pump's close ends the wait early. Returns
        whether it paused; the time is added to ``held``."""
        assert self._throttle is not None
        began = self._clock()
        pause = self._throttle(n)
        paused = pause > 0
        while pause > 0 and not (self._aborted or self._closing):
            time.sleep(pause)
            pause = self._throttle(0)
        if paused:
            self.held += self._clock() - began
        return paused

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
        t.stream.release_socket(self._read_timeout)
        if error is None:
            t.done.set_result(t.pos - t.start)
        else:
            t.done.set_exception(error)
