"""The body-transfer path (``shardsync.fetch.wire``) against servers that answer raw bytes.

The whole suite downloads through it (every loopback server without a proxy); these tests
aim at what only it parses: the response head, the body framing, keep-alive reuse, and the
answers it hands back to aiohttp's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import filecmp
import hashlib
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web
from helpers import fast_config, random_shard, range_server

from shardsync.digest import Digest, MappedFile
from shardsync.errors import ConfigError, ProtocolError
from shardsync.fetch.disk import write_all
from shardsync.fetch.pump import _WAKE_EVERY, _set_lowat, _track_rate, _Transfer
from shardsync.fetch.wire import BodyTruncated, RangeReader
from shardsync.prefetch import prefetch
from shardsync.testing import Bandwidth, FakeHub, serve_in_thread

Answer = Callable[[bytes], bytes]
"""Given a request's bytes, the raw bytes a connection answers (then it waits for the next)."""


Converse = Callable[[socket.socket, bytes, threading.Event], bool]
"""Answers one request (its bytes) on a connection; False ends the connection."""


@contextmanager
def loopback(converse: Converse, path: str) -> Iterator[tuple[str, list[int]]]:
    """A loopback server that reads each request's head and lets ``converse`` answer it;
    yields the URL of ``path`` and a list that gets one entry per accepted connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections: list[int] = []
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while not stop.is_set():
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                if not converse(conn, data, stop):
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(1)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}{path}", connections
    finally:
        stop.set()
        listener.close()


@contextmanager
def raw_server(answer: Answer, *, close_after: bool = False) -> Iterator[tuple[str, list[int]]]:
    """A loopback server writing ``answer(request)`` per request."""

    def converse(conn: socket.socket, request: bytes, stop: threading.Event) -> bool:
        conn.sendall(answer(request))
        return not close_after

    with loopback(converse, "/blob") as served:
        yield served


def reader() -> RangeReader:
    return RangeReader(None, connect_timeout=5, read_timeout=5)


def read_all(url: str, rd: RangeReader) -> tuple[int, bytes]:
    stream = rd.open(url, {})
    try:
        out = bytearray(stream.length or 0)
        with memoryview(out) as view:
            got = 0
            while got < len(out):
                got += stream.readinto(view[got:])
        return stream.head.status, bytes(out)
    finally:
        stream.close()


def ok(body: bytes, extra: str = "") -> Answer:
    return lambda _req: (
        f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body
    )


def test_a_kept_alive_connection_is_reused_and_a_closing_one_is_not() -> None:
    with raw_server(ok(b"x" * 1000)) as (url, connections):
        rd = reader()
        assert read_all(url, rd) == (200, b"x" * 1000)
        assert read_all(url, rd) == (200, b"x" * 1000)
        assert len(connections) == 1
        rd.close()
    with raw_server(ok(b"y" * 10, "Connection: close\r\n")) as (url, connections):
        rd = reader()
        read_all(url, rd)
        read_all(url, rd)
        assert len(connections) == 2
        rd.close()


def test_a_pooled_connection_the_server_closed_is_replaced_once() -> None:
    with raw_server(ok(b"z" * 100), close_after=True) as (url, connections):
        rd = reader()
        assert read_all(url, rd) == (200, b"z" * 100)
        # the server hung up after answering: the next request finds a dead pooled socket
        assert read_all(url, rd) == (200, b"z" * 100)
        assert len(connections) == 2
        rd.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK\r\nContent-Length: 1\r\n\r\nx",
        b"ICY 200 OK\r\n\r\n",
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 1\r\n\r\nx",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n continued: header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\nx",
    ],
    ids=["http2", "not-http", "bad-code", "no-colon", "folded", "huge-head", "huge-length"],
)
def test_a_malformed_head_is_a_protocol_error(head: bytes) -> None:
    with raw_server(lambda _req: head) as (url, _):
        rd = reader()
        with pytest.raises(ProtocolError):
            rd.open(url, {})
        rd.close()


def test_a_body_cut_short_is_a_retryable_connection_error() -> None:
    cut = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nabc"
    with raw_server(lambda _req: cut, close_after=True) as (url, _):
        rd = reader()
        with pytest.raises(BodyTruncated):
            read_all(url, rd)
        rd.close()


@contextmanager
def dripping_server(size: int) -> Iterator[str]:
    """Answers a HEAD at once (``size`` bytes, for a plain-URL origin), but a GET's head a
    byte every 50 ms, never ending it: each byte well within any read timeout."""

    def converse(conn: socket.socket, request: bytes, stop: threading.Event) -> bool:
        if request.startswith(b"HEAD"):
            conn.sendall(b'HTTP/1.1 200 OK\r\nETag: "v1"\r\nContent-Length: %d\r\n\r\n' % size)
            return True
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\n")
        while not stop.wait(0.05):
            conn.sendall(b"X")
        return False

    with loopback(converse, "/ckpt/") as (url, _):
        yield url


def test_a_head_that_drips_in_times_out_as_a_whole() -> None:
    """``read_timeout`` bounds the whole response head, not each of its bytes."""
    rd = RangeReader(None, connect_timeout=5, read_timeout=0.5)
    with ThreadPoolExecutor(1) as pool, dripping_server(100) as url:
        opening = pool.submit(rd.open, url + "model.safetensors", {"Range": "bytes=0-9"})
        done, _ = wait([opening], timeout=3.0)  # the server's stop ends it otherwise
        assert opening in done
        assert isinstance(opening.exception(), TimeoutError)
    rd.close()


async def test_a_cancel_stops_a_request_whose_head_drips_in(tmp_path: Path) -> None:
    """A cancelled prefetch returns at once, though its worker threads are still reading
    heads (a read timeout away from ending): their sockets are shut down under them."""
    config = fast_config(tmp_path, read_timeout=30.0)
    with dripping_server(4 << 20) as url:
        task = asyncio.ensure_future(prefetch(url, config))
        await asyncio.sleep(1.0)  # every connection is reading a head by now
        assert not task.done()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        assert task in done


def request_sent(suffix: str, headers: dict[str, str]) -> tuple[str, bytes]:
    """Open ``<url><suffix>`` with ``headers`` against a server that answers an empty 200;
    returns the URL and the bytes of the request it received."""
    seen: list[bytes] = []

    def answer(req: bytes) -> bytes:
        seen.append(req)
        return ok(b"")(req)

    with raw_server(answer) as (url, _):
        rd = reader()
        rd.open(url + suffix, headers).close()
        rd.close()
    return url, seen[0]


def test_the_request_carries_host_range_and_headers() -> None:
    url, request = request_sent("?sig=1", {"Range": "bytes=0-9", "X-A": "b"})
    lines = request.decode().split("\r\n")
    assert lines[0] == "GET /blob?sig=1 HTTP/1.1"
    port = url.split(":")[2].split("/")[0]
    assert f"Host: 127.0.0.1:{port}" in lines
    assert "Range: bytes=0-9" in lines and "X-A: b" in lines


async def test_a_chunked_206_goes_through_aiohttp_and_lands_intact(tmp_path: Path) -> None:
    """A 206 without Content-Length is not read by the worker threads: the range is asked
    again on aiohttp's path, which reads any framing, and the file lands intact."""
    data = random_shard(3 << 20)
    ranges: list[str] = []

    async def send(response: web.StreamResponse, first: int, last: int) -> None:
        ranges.append(f"bytes={first}-{last}")
        await response.write(data[first : last + 1])

    async with range_server(data, send, chunked=True) as url:
        result = await prefetch(url, fast_config(tmp_path / "cache", chunk_size=1 << 20))
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    assert len(ranges) == 2 * len(set(ranges)) == 6  # each range asked once per path


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-A", "b\r\nInjected: 1"), ("X-A", "b\nc"), ("X A", "b"), ("X-A:", "b"), ("X-A", "\x00")],
)
def test_a_header_that_could_split_the_request_is_refused(name: str, value: str) -> None:
    with raw_server(ok(b"")) as (url, connections):
        rd = reader()
        with pytest.raises(ConfigError):
            rd.open(url, {name: value})
        rd.close()
        assert connections == []  # refused before connecting


def test_a_target_with_spaces_or_line_breaks_is_percent_encoded() -> None:
    _url, request = request_sent("/a b\r\nX-Evil: 1/\u00e9", {})
    request_line, *headers = request.decode("latin-1").split("\r\n")
    # urlsplit drops CR and LF; what is left is quoted, so it stays one request line
    assert request_line == "GET /blob/a%20bX-Evil:%201/%C3%A9 HTTP/1.1"
    assert not any(h.startswith("X-Evil") for h in headers)


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or (line[:1] in "abcdef" and "-" in line.split(" ", 1)[0]):
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_the_hash_maps_one_window_at_a_time_and_reads_the_bytes_in_place(
    tmp_path: Path,
) -> None:
    page = mmap.PAGESIZE
    path = tmp_path / "partial"
    data = os.urandom(64 * page + 100)
    with path.open("w+b") as f:
        f.truncate(len(data))  # as a slot makes a partial
        write_all(f.fileno(), [data], 0)  # as the pump does
        pages = MappedFile(f.fileno(), len(data), window=16 * page)
        digest = Digest()
        assert pages.hash_into(digest, 0, 20 * page + 7) == 20 * page + 7
        assert 0 < _mapped_rss(path) <= 16 * page  # the window holding the frontier only
        assert pages.hash_into(digest, 20 * page + 7, 32 * page) == 32 * page
        assert _mapped_rss(path) == 0  # a window the hash has passed is unmapped
        assert pages.hash_into(digest, 32 * page, len(data)) == len(data)
        pages.close()
        assert _mapped_rss(path) == 0
    assert digest.sha256 == hashlib.sha256(data).hexdigest()
    assert digest.nbytes == len(data)


def test_a_file_that_shrank_under_the_hash_is_reported_short(tmp_path: Path) -> None:
    path = tmp_path / "partial"
    path.write_bytes(os.urandom(3 << 20))
    with path.open("r+b") as f:
        pages = MappedFile(f.fileno(), 3 << 20, window=1 << 20)
        digest = Digest()
        assert pages.hash_into(digest, 0, 1 << 20) == 1 << 20
        f.truncate((3 << 20) // 2)  # someone else cut it: no SIGBUS, a short count
        assert pages.hash_into(digest, 1 << 20, 3 << 20) == (3 << 20) // 2
        pages.close()


_PEAK_RSS_OF_PREFETCH = """
import sys
from shardsync.cli import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
sys.exit(code)
"""


def test_a_download_does_not_keep_the_file_resident(tmp_path: Path) -> None:
    """The hasher reads the partial file through a mapping, a window at a time, each
    unmapped once passed, so a download's peak RSS does not grow with the file (before:
    by all of it)."""
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    size, block = 768 << 20, os.urandom(8 << 20)
    with big.open("wb") as f:
        for n in range(size // len(block)):
            f.write(n.to_bytes(8) + block[8:])
    small.write_bytes(os.urandom(1 << 20))
    hub = FakeHub()
    hub.add_repo("acme/big", {"model.safetensors": big})
    hub.add_repo("acme/small", {"model.safetensors": small})
    # 4 x 50 MB/s, well under what one core hashes: at full loopback speed the hash lags
    # by whatever the CPU allows (137-658 MiB on the 2-core CI box), and that lag is resident
    hub.faults.add(Bandwidth(50_000_000, path="*.safetensors"))

    config = tmp_path / "shardsync.toml"  # about 4 x 16 MiB written ahead of the hash
    config.write_text('[download]\nconnections_per_file = 4\nchunk_size = "16MiB"\n')

    def peak_rss(repo: str) -> int:
        """VmHWM of the prefetch's own process (ru_maxrss would include this one's, from the
        fork before exec)."""
        argv = [sys.executable, "-c", _PEAK_RSS_OF_PREFETCH, "--config", str(config)]
        argv += ["prefetch", repo, "--quiet"]
        argv += ["--no-daemon", "--endpoint", running.endpoint]
        argv += ["--cache-dir", str(tmp_path / repo)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        return int(out.stdout.split()[-1]) * 1024

    with serve_in_thread(hub) as running:
        baseline = peak_rss("acme/small")
        grown = peak_rss("acme/big") - baseline
    blob = next((tmp_path / "acme/big").rglob("blobs/*"))
    assert filecmp.cmp(blob, big, shallow=False)
    # what stays is the window in flight (connections x chunk), not the file
    assert grown < size // 4, f"peak RSS grew by {grown >> 20} MiB for a {size >> 20} MiB file"


async def test_a_body_whose_end_trickles_in_is_not_timed_out(tmp_path: Path) -> None:
    """The pump asks the kernel to wake it only once a few ms of a connection's data have
    arrived (``SO_RCVLOWAT``). Bytes that then arrive slowly, each well within
    ``read_timeout``, must still wake it: a connection is dropped for silence, not slowness."""
    data = random_shard(64 << 20)  # long enough at full speed for its rate to count
    fast = len(data) - (256 << 10)

    async def send(response: web.StreamResponse, first: int, last: int) -> None:
        await response.write(data[first : min(last + 1, fast)])
        for pos in range(max(first, fast), last + 1, 32 << 10):  # the end: 32 KiB per 0.25 s
            await asyncio.sleep(0.25)
            await response.write(data[pos : min(last + 1, pos + (32 << 10))])

    config = fast_config(tmp_path, connections_per_file=1, chunk_size=len(data), read_timeout=1.0)
    async with range_server(data, send) as url:
        result = await prefetch(url, config)
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    (outcome,) = [f for f in result.files if f.path == "model.safetensors"]
    assert outcome.downloaded == len(data)  # one request did it: no timeout, no retry


async def test_an_honest_short_206_is_read_to_its_end_without_a_wait(tmp_path: Path) -> None:
    """A server that answers each range with at most 700 KiB (Content-Range and
    Content-Length agree) at a steady rate, its last KiB a moment later: the wake-up mark
    follows what the body has left, not the range asked, or that KiB sits in the kernel
    until the read timeout."""
    data = random_shard(4 << 20)
    cap = 700 << 10

    async def send(out: web.StreamResponse, first: int, last: int) -> None:
        tail = last + 1 - 1024
        for pos in range(first, tail, 64 << 10):
            await out.write(data[pos : min(pos + (64 << 10), tail)])
            await asyncio.sleep(0.003)  # about 20 MB/s: the pump sizes its wake-ups to it
        await asyncio.sleep(0.05)
        await out.write(data[tail : last + 1])  # far less than a wake-up's worth

    config = fast_config(tmp_path, chunk_size=1 << 20, read_size=1 << 20, read_timeout=3.0)
    async with range_server(data, send, most=cap) as base:
        result = await prefetch(base, config)
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    assert result.fetch is not None and "timeout" not in result.fetch.retries


async def test_writeback_starts_as_the_hash_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashed bytes are sent to the disk in 8 MiB steps while the download runs
    (``sync_file_range``), so the fsync before publishing finds them written: on this VM a
    512 MiB file's final fsync took 0.16-0.19 s without, 0.00 s with."""
    import shardsync.fetch.transfer

    real = shardsync.fetch.transfer.start_writeback
    asked: list[tuple[int, int]] = []

    def spy(fd: int, start: int, end: int) -> None:
        asked.append((start, end))
        real(fd, start, end)

    monkeypatch.setattr(shardsync.fetch.transfer, "start_writeback", spy)
    data = random_shard(20 << 20)

    async def send(response: web.StreamResponse, first: int, last: int) -> None:
        await response.write(data[first : last + 1])

    async with range_server(data, send) as url:
        result = await prefetch(url, fast_config(tmp_path, chunk_size=1 << 20))
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
    assert [start for start, _ in asked] == [0, *(end for _, end in asked[:-1])]  # in order
    assert asked[-1][1] == len(data)  # all of it
    assert all(end - start >= 8 << 20 for start, end in asked[:-1])  # in steps, not per piece


class _Unbuffered:
    remaining = None  # a body without a length: the range asked bounds the wake-ups

    def buffered_bytes(self) -> int:
        return 0


def test_wake_ups_are_sized_to_the_lower_of_the_recent_and_the_average_rate() -> None:
    """A socket wakes the pump once ``_WAKE_EVERY`` of its data has arrived; what is below
    that mark stays in the kernel until more comes, and a kill loses it. nginx's
    ``limit_rate`` sends a request's first second at once, then bursts: sized to the burst
    reads, a mark stranded up to 1 MiB per connection between bursts; sized to the average
    since the request began, it stayed high long after the first burst."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        t = _Transfer(_Unbuffered(), ours, 0, 0, 1 << 40, print, print, Future(), 0.0)  # type: ignore[arg-type]

        def read(n: int, at: float) -> None:
            previous, t.last = t.last, at
            t.pos += n
            _track_rate(t, n, previous, at)
            _set_lowat(t, t.rate)

        # bursts: 2.5 MB every 100 ms, read in 4 quick pieces (25 MB/s on average)
        for burst in range(1, 11):
            for k in range(4):
                read(625_000, 0.1 * burst + 0.0005 * k)
            assert t.lowat <= 1.25 * _WAKE_EVERY * t.pos / t.last
        # a first burst of 4 MB, then a steady 25 MB/s in 125 KB reads
        t.pos, t.rate, t.recent, t.lowat, t.began = 0, None, None, 1, 10.0
        t.last = 10.0
        for k in range(8):
            read(500_000, 10.021 + 0.0005 * k)
        for k in range(1, 60):
            read(125_000, 10.025 + 0.005 * k)
        assert t.lowat <= 1.25 * _WAKE_EVERY * 25e6


@pytest.mark.parametrize(
    "code", [errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ETIMEDOUT]
)
async def test_a_route_that_flaps_is_retried_on_the_pumps_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """The kernel's word for a route gone a moment (an ICMP host unreachable, a network
    down, a connect that timed out) is an ``OSError`` of that errno, not a
    ``ConnectionError``: the pump's connections meet it where aiohttp's meet it wrapped,
    and it is retried on both. The first connection the pump opens meets it here."""
    data = random_shard(1 << 20)
    real = socket.create_connection
    failed: list[int] = []

    def flapping(*args: object, **kwargs: object) -> socket.socket:
        if not failed:
            failed.append(code)
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    async def send(out: web.StreamResponse, first: int, last: int) -> None:
        await out.write(data[first : last + 1])

    monkeypatch.setattr(socket, "create_connection", flapping)
    async with range_server(data, send) as url:
        result = await prefetch(url, fast_config(tmp_path))
    assert failed == [code]
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
