"""Conflicting HTTP framing (promise 13), from a server that writes its answers byte by byte.

aiohttp's server frames every answer correctly, so no fake built on it can send what a
smuggling proxy or a broken origin sends: ``Transfer-Encoding`` beside ``Content-Length``,
two lengths, a chunk whose size lies, a chunked 206 that ends early. ``RawOrigin`` can. Each
lie is answered by a clear `ShardsyncError` (when it never stops) or ends byte-exact (when a
retry gets a true answer); the raw bytes of a misframed body are never published. Every case
runs on each body path (``tests/bodypaths.py``): the pump reads direct answers, aiohttp the
proxied ones (the relay passes the lies on as sent) and the chunked ones.
"""

from __future__ import annotations

import asyncio
import gzip
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from bodypaths import BodyPath
from helpers import assert_store_verified, fast_config

from shardsync.errors import ShardsyncError
from shardsync.prefetch import prefetch
from shardsync.records import PrefetchResult

SHARD = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + os.urandom(1 << 20)
FILES = {"model.safetensors": SHARD}
ETAG = '"v1"'
RANGE_SIZE = 256 * 1024

Lie = Callable[[bytes, int, int], bytes | tuple[bytes, ...]]
"""Given the file and the asked range ``[start, end]``, the whole answer as sent (head and
body) to a Range GET; the parts of a tuple go with a pause between them."""
PAUSE = 0.05


def chunked(body: bytes, piece: int = 16 * 1024) -> bytes:
    """`body` in the chunked coding, true to its sizes."""
    out = b"".join(
        b"%x\r\n" % len(body[i : i + piece]) + body[i : i + piece] + b"\r\n"
        for i in range(0, len(body), piece)
    )
    return out + b"0\r\n\r\n"


def head(status: str, *fields: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *fields, "Connection: close"]) + "\r\n\r\n").encode()


def content_range(data: bytes, start: int, end: int) -> str:
    return f"Content-Range: bytes {start}-{end}/{len(data)}"


def length_beside_chunked(data: bytes, start: int, end: int) -> bytes:
    """A length that counts the chunked coding's own bytes: read by it, the body starts with
    the first chunk's size line (RFC 9112 6.3: Transfer-Encoding wins; refuse or decode)."""
    body = chunked(data[start : end + 1])
    return (
        head(
            "206 Partial Content",
            f"ETag: {ETAG}",
            content_range(data, start, end),
            f"Content-Length: {end - start + 1}",
            "Transfer-Encoding: chunked",
        )
        + body
    )


def two_lengths(data: bytes, start: int, end: int) -> bytes:
    """Two different lengths: which one frames the body is anyone's guess."""
    n = end - start + 1
    return (
        head(
            "206 Partial Content",
            f"ETag: {ETAG}",
            content_range(data, start, end),
            f"Content-Length: {n}",
            f"Content-Length: {n - 100}",
        )
        + data[start : end + 1]
    )


def lying_chunk_size(data: bytes, start: int, end: int) -> tuple[bytes, ...]:
    """A first chunk that says it holds 8 KiB more than it does: taken at its word, the
    next chunk's size line is read as data. Those bytes arrive first; what shows the lie
    (no line end where the chunk says it ends) only after a pause, as over a real network."""
    body = data[start : end + 1]
    first, rest = body[:16384], body[16384:]
    sent = (
        head(
            "206 Partial Content",
            f"ETag: {ETAG}",
            content_range(data, start, end),
            "Transfer-Encoding: chunked",
        )
        + b"%x\r\n" % (len(first) + 8192)
        + first
        + b"\r\n"
        + chunked(rest)
    )
    said_end = sent.index(first) + len(first) + 8192  # where the chunk says it ends
    return sent[:said_end], sent[said_end:]


def short_chunked_206(data: bytes, start: int, end: int) -> bytes:
    """A chunked 206 that ends, cleanly, after half of what its Content-Range promises."""
    half = data[start : start + (end - start + 1) // 2]
    return head(
        "206 Partial Content",
        f"ETag: {ETAG}",
        content_range(data, start, end),
        "Transfer-Encoding: chunked",
    ) + chunked(half)


def superscript_length(data: bytes, start: int, end: int) -> bytes:
    """A length of one latin-1 byte, "\u00b2": ``str.isdigit`` takes it for a digit,
    ``int`` does not (it ended the download in a ValueError)."""
    return (
        head("206 Partial Content", f"ETag: {ETAG}", content_range(data, start, end)).replace(
            b"Connection: close", b"Content-Length: \xb2\r\nConnection: close"
        )
        + data[start : end + 1]
    )


def superscript_status(data: bytes, start: int, end: int) -> bytes:
    """A status of "\u00b206": three "digits" to ``str.isdigit``, none to ``int``."""
    body = data[start : end + 1]
    return head(
        "206 Partial Content", f"ETag: {ETAG}", content_range(data, start, end),
        f"Content-Length: {len(body)}",
    ).replace(b"HTTP/1.1 206", b"HTTP/1.1 \xb206", 1) + body  # fmt: skip


def gzip_transfer_coding(data: bytes, start: int, end: int) -> bytes:
    """``Transfer-Encoding: gzip, chunked``, a coding nobody asked for: de-chunked, the body
    is the range gzipped, and random bytes (weights nearly are) gzip to as many again."""
    return head(
        "206 Partial Content",
        f"ETag: {ETAG}",
        content_range(data, start, end),
        "Transfer-Encoding: gzip, chunked",
    ) + chunked(gzip.compress(data[start : end + 1]))


LIES = [
    length_beside_chunked, two_lengths, lying_chunk_size, short_chunked_206,
    superscript_length, superscript_status, gzip_transfer_coding,
]  # fmt: skip
PERSISTENT = [
    length_beside_chunked, two_lengths, lying_chunk_size, superscript_length, superscript_status,
    gzip_transfer_coding,
]  # fmt: skip


@dataclass
class RawOrigin:
    """Serves ``FILES`` under ``/ckpt/``; a Range GET gets ``lie`` while ``times`` lasts
    (None: forever). True answers are framed by ``Content-Length``, or chunked when
    ``chunk_true_answers``. One answer per connection."""

    lie: Lie | None = None
    times: int | None = 0
    chunk_true_answers: bool = False
    told: int = 0
    asked: list[str] = field(default_factory=list)
    serving: set[asyncio.Task[None]] = field(default_factory=set)

    async def stop(self) -> None:
        """End the answers still being sent (one may wait out a pause)."""
        for task in list(self.serving):
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.serving.add(task)
        task.add_done_callback(self.serving.discard)
        try:
            request = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            answer = self.answer(request)
            for i, part in enumerate(answer if isinstance(answer, tuple) else (answer,)):
                if i:
                    await asyncio.sleep(PAUSE)
                writer.write(part)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client hung up, or the test is over (``stop``)
        finally:
            writer.close()

    def answer(self, request: str) -> bytes | tuple[bytes, ...]:
        line, *fields = request.split("\r\n")
        method, target, _ = line.split(" ", 2)
        headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
        data = FILES.get(target.removeprefix("/ckpt/"))
        if data is None:
            return head("404 Not Found", "Content-Length: 0")
        if method == "HEAD":
            return head(
                "200 OK", f"ETag: {ETAG}", "Accept-Ranges: bytes", f"Content-Length: {len(data)}"
            )
        ranged = headers.get("range")
        start, end = 0, len(data) - 1
        if ranged is not None:
            first, _, last = ranged.removeprefix("bytes=").partition("-")
            start, end = int(first), min(int(last), len(data) - 1)
            self.asked.append(ranged)
            if self.lie is not None and (self.times is None or self.told < self.times):
                self.told += 1
                return self.lie(data, start, end)
        status = "206 Partial Content" if ranged is not None else "200 OK"
        fields_out = [f"ETag: {ETAG}"]
        if ranged is not None:
            fields_out.append(content_range(data, start, end))
        body = data[start : end + 1]
        if self.chunk_true_answers:
            return head(status, *fields_out, "Transfer-Encoding: chunked") + chunked(body)
        return head(status, *fields_out, f"Content-Length: {len(body)}") + body


@pytest.fixture
async def origin(body_path: BodyPath) -> AsyncIterator[tuple[RawOrigin, str]]:
    state = RawOrigin(chunk_true_answers=body_path.chunked)
    server = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield state, f"http://127.0.0.1:{port}/ckpt/"
    finally:
        server.close()
        await state.stop()
        await server.wait_closed()


def published_refs(cache: Path) -> list[Path]:
    """The refs of the snapshots published: a ref is written last."""
    return list(cache.glob("other/*/refs/*"))


async def run(base: str, cache: Path, path: BodyPath) -> PrefetchResult:
    # aiohttp stops reading a body whose chunk lied without a word: the read timeout (kept
    # short here) is what ends it
    config = fast_config(cache, chunk_size=RANGE_SIZE, read_timeout=0.5)
    return await prefetch(base, path.configure(config))


@pytest.mark.parametrize("lie", LIES, ids=[lie.__name__ for lie in LIES])
async def test_a_misframed_answer_that_passes_ends_byte_exact(
    origin: tuple[RawOrigin, str], tmp_path: Path, body_path: BodyPath, lie: Lie
) -> None:
    """Two lies, then the truth: the file is the origin's, byte for byte, although nothing
    but the framing rules stands in the way (a plain URL publishes no hash)."""
    state, base = origin
    state.lie, state.times = lie, 2
    result = await run(base, tmp_path, body_path)
    assert state.told == 2
    assert (result.snapshot_path / "model.safetensors").read_bytes() == SHARD
    assert_store_verified(tmp_path, FILES)
    if body_path.relay is not None:
        assert body_path.relay.statuses("GET")


@pytest.mark.parametrize("lie", PERSISTENT, ids=[lie.__name__ for lie in PERSISTENT])
async def test_a_misframed_answer_that_never_stops_is_one_clear_error(
    origin: tuple[RawOrigin, str], tmp_path: Path, body_path: BodyPath, lie: Lie
) -> None:
    state, base = origin
    state.lie, state.times = lie, None
    with pytest.raises(ShardsyncError):
        await run(base, tmp_path, body_path)
    assert state.told > 0
    assert_store_verified(tmp_path, FILES)
    assert published_refs(tmp_path) == []
