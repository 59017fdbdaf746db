"""``shardsync.testing.relay.Relay``: it passes a server's answer on as the server framed it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from shardsync.testing.relay import Relay, without_fields

MISFRAMED = (
    b'HTTP/1.1 206 Partial Content\r\nETag: "v1"\r\nContent-Range: bytes 0-4/10\r\n'
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
)


@pytest.fixture
async def origin() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server that answers every request with ``MISFRAMED`` and records the requests."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(MISFRAMED)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        server.close()
        await server.wait_closed()


async def exchange(relay: Relay, request: bytes) -> bytes:
    host, port = relay.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    return answer


async def test_a_forward_proxy_passes_the_framing_on_as_sent(
    origin: tuple[str, list[bytes]],
) -> None:
    base, seen = origin
    async with Relay() as relay:
        answer = await exchange(
            relay, f"GET {base}/f?x=1 HTTP/1.1\r\nHost: h\r\nRange: bytes=0-4\r\n\r\n".encode()
        )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert body == MISFRAMED.partition(b"\r\n\r\n")[2]  # the chunked coding itself, untouched
    assert b"Content-Length: 5\r\nTransfer-Encoding: chunked" in head
    assert head.endswith(b"Connection: close")
    (request,) = seen
    assert request.startswith(b"GET /f?x=1 HTTP/1.1\r\n") and b"Range: bytes=0-4" in request
    (logged,) = relay.log
    assert (logged.method, logged.url, logged.status) == ("GET", f"{base}/f?x=1", 206)


async def test_a_gateway_edits_the_heads_it_is_told_to(origin: tuple[str, list[bytes]]) -> None:
    base, _seen = origin
    async with Relay(upstream=base, edit_head=without_fields("ETag", status=206)) as gateway:
        answer = await exchange(gateway, b"GET /f HTTP/1.1\r\nHost: h\r\n\r\n")
        assert gateway.statuses("GET") == [206]
    assert b"ETag" not in answer.partition(b"\r\n\r\n")[0]
    assert answer.endswith(b"5\r\nhello\r\n0\r\n\r\n")


async def test_only_plain_http_is_relayed() -> None:
    with pytest.raises(ValueError, match="plain http"):
        Relay(upstream="https://127.0.0.1:1")
    async with Relay() as relay:
        answer = await exchange(relay, b"GET https://127.0.0.1:1/ HTTP/1.1\r\nHost: h\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 501")


async def test_a_body_behind_expect_100_continue_reaches_the_server(
    origin: tuple[str, list[bytes]],
) -> None:
    """botocore sends ``Expect: 100-continue`` and waits before a PUT's body: the relay
    answers the 100 itself, then carries the body."""
    base, seen = origin
    async with Relay(upstream=base) as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"PUT /k HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n"
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"data")
        answer = await reader.read()
        writer.close()
        await writer.wait_closed()
    assert answer.startswith(b"HTTP/1.1 206")
    (request,) = seen
    assert b"Expect" not in request


async def test_a_paced_relay_counts_the_body_bytes_it_hands_on(
    origin: tuple[str, list[bytes]],
) -> None:
    """The count is of bodies only (what a server's answers cost), and a paced answer still
    arrives whole."""
    base, _seen = origin
    body = MISFRAMED.partition(b"\r\n\r\n")[2]
    async with Relay(upstream=base, rate=10_000) as gateway:
        answers = [await exchange(gateway, b"GET /f HTTP/1.1\r\nHost: h\r\n\r\n") for _ in "ab"]
        assert gateway.body_bytes == 2 * len(body)
    assert [a.partition(b"\r\n\r\n")[2] for a in answers] == [body, body]


async def test_a_gateway_edits_requests_and_sends_bodies_chunked() -> None:
    """``edit_request`` changes what the server is asked (here: the Range it reads), and
    ``chunked`` re-frames a body the server sent by its length; a HEAD keeps its length."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
        if not head.startswith(b"HEAD"):
            writer.write(b"hello")
        await writer.drain()
        writer.close()

    def move(method: str, target: str, fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(n, "bytes=9-9" if n.lower() == "range" else v) for n, v in fields]

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with Relay(upstream=base, edit_request=move, chunked=True) as gateway:
            got = await exchange(gateway, b"GET /f HTTP/1.1\r\nHost: h\r\nRange: bytes=0-4\r\n\r\n")
            headed = await exchange(gateway, b"HEAD /f HTTP/1.1\r\nHost: h\r\n\r\n")
    finally:
        server.close()
        await server.wait_closed()
    assert b"Range: bytes=9-9" in seen[0] and b"bytes=0-4" not in seen[0]
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and b"Content-Length" not in head
    assert body == b"5\r\nhello\r\n0\r\n\r\n"
    assert b"Content-Length: 5" in headed and b"chunked" not in headed
