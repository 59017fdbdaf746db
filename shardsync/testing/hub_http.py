"""The HTTP side of the fake hub, apart from its routes: what a request asks (its Range,
conditions, token, flags), how errors and bodies are answered the way the Hub and its CDN
answer them, and the faults a body can carry (a cut, a flipped byte, a pace).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from aiohttp import web
from multidict import CIMultiDict

from shardsync.testing.faults import Effects
from shardsync.testing.hub_repos import Blob, MemoryBlob

__all__ = [
    "UNSATISFIABLE",
    "Exchange",
    "RequestRecord",
    "Span",
    "bearer",
    "decode_cursor",
    "drop_connection",
    "encode_cursor",
    "error_response",
    "flag",
    "if_match_matches",
    "if_range_matches",
    "parse_range",
    "replaced",
    "shifted",
    "write_body",
]

_CHUNK_SIZE = 1024 * 1024
_NUMBER_RE = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the fake hub saw it, and what it answered."""

    server: Literal["hub", "cdn"]
    method: str
    path: str
    """The raw (still percent-encoded) URL path."""
    query: Mapping[str, str]
    headers: Mapping[str, str]
    """The request headers, case-insensitive."""
    status: int
    """The status sent, or 0 when the client went away before any was."""
    range: str | None
    """The request's ``Range`` header."""
    bytes_sent: int
    """Body bytes written, up to a cut or a disconnect."""
    file: str | None
    """The repository file path the request was about, if any."""


@dataclass(eq=False, slots=True)
class Exchange:
    """What a handler learns while answering, for the record written when it finishes."""

    file: str | None = None
    status: int = 0
    bytes_sent: int = 0


@dataclass(frozen=True, slots=True)
class Span:
    start: int
    stop: int


UNSATISFIABLE: Final = "unsatisfiable"
_RANGE_RE = re.compile(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", re.ASCII | re.IGNORECASE)


def parse_range(value: str, size: int) -> Span | Literal["unsatisfiable"] | None:
    """Parse a ``Range`` header for a `size`-byte body; None means "ignore it, send 200".

    Syntax errors and multi-ranges are ignored, as RFC 9110 allows; a well-formed range that
    selects nothing is unsatisfiable.
    """
    match = _RANGE_RE.fullmatch(value)
    if match is None or not (match[1] or match[2]):
        return None
    if not match[1]:
        suffix = int(match[2])
        if suffix == 0 or size == 0:
            return UNSATISFIABLE
        return Span(max(size - suffix, 0), size)
    start = int(match[1])
    last = int(match[2]) if match[2] else None
    if last is not None and last < start:
        return None
    if start >= size:
        return UNSATISFIABLE
    return Span(start, size if last is None else min(last + 1, size))


def if_match_matches(if_match: str, etag: str | None) -> bool:
    """``If-Match``: ``*`` or one of the listed strong ETags is the object's (RFC 9110 13.1.1)."""
    if etag is None:
        return False
    listed = [tag.strip() for tag in if_match.split(",")]
    return "*" in listed or etag in listed


def if_range_matches(if_range: str | None, etag: str) -> bool:
    """Strong comparison; a weak ETag or a date never matches (we send no Last-Modified)."""
    return if_range is None or (not if_range.startswith("W/") and if_range.strip() == etag)


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    all_headers = CIMultiDict(headers or {})
    all_headers["X-Error-Message"] = message
    if code is not None:
        all_headers["X-Error-Code"] = code
    return web.Response(
        status=status,
        body=json.dumps({"error": message}).encode(),
        content_type="application/json",
        headers=all_headers,
    )


def bearer(request: web.BaseRequest) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def flag(request: web.BaseRequest, name: str) -> bool:
    return request.query.get(name, "").lower() in ("1", "true")


def replaced(effects: Effects, blob: Blob) -> Blob:
    """What the URL serves now: a `ReplaceObject` fault's content, or the stored blob."""
    return blob if effects.replacement is None else MemoryBlob(effects.replacement.content)


def shifted(span: Span, shift: int, size: int) -> Span:
    """`span` moved by `shift` bytes and clipped to a `size`-byte body (never empty)."""
    if shift == 0:
        return span
    start = min(max(span.start + shift, 0), size - 1)
    return Span(start, min(max(span.stop + shift, start + 1), size))


def flipped(data: bytes | memoryview, index: int) -> bytes:
    changed = bytearray(data)
    changed[index] ^= 0xFF
    return bytes(changed)


def encode_cursor(offset: int) -> str:
    return base64.urlsafe_b64encode(f"offset:{offset}".encode()).decode()


def decode_cursor(cursor: str | None) -> int | None:
    """The offset a cursor stands for (0 without one), or None if it is not ours."""
    if cursor is None:
        return 0
    try:
        text = base64.urlsafe_b64decode(cursor.encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    prefix, _, offset = text.partition(":")
    return int(offset) if prefix == "offset" and _NUMBER_RE.fullmatch(offset) else None


def drop_connection(request: web.BaseRequest) -> None:
    """Close the connection once what was written is flushed: the client sees a short body."""
    if request.transport is not None:
        request.transport.close()


async def write_body(
    request: web.BaseRequest,
    response: web.StreamResponse,
    exchange: Exchange,
    blob: Blob,
    span: Span,
    effects: Effects,
) -> None:
    length = span.stop - span.start
    cut = effects.cut_after(length)
    flip = effects.flip_at(length)
    pacer = effects.pacer()
    end = length if cut is None else cut
    chunk = pacer.chunk if pacer is not None else _CHUNK_SIZE
    if effects.chunked is not None:
        chunk = min(chunk, effects.chunked)
    sent = 0
    try:
        while sent < end:
            n = min(chunk, end - sent)
            data = blob.read(span.start + sent, n)
            if flip is not None and sent <= flip < sent + n:
                data = flipped(data, flip - sent)
            if pacer is not None and (delay := pacer.delay(n)) > 0:
                await asyncio.sleep(delay)
            await response.write(data)
            sent += n
            exchange.bytes_sent = sent
    except ConnectionError:
        return  # the client hung up; what it got is recorded
    if cut is not None:
        drop_connection(request)
