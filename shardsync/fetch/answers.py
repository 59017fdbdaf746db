"""What an HTTP answer means: the error it is, whether a retry, a fresh URL or a restart may
help, where a redirect or a next page leads, and the resume proof.

The resume proof is both halves here: what a Range request carries (``range_headers``: the
ETag first seen, in ``If-Range`` or ``If-Match``) and what its answer must show
(``check_range_answer``: a ``206`` for exactly the asked bytes of that object). Both body
paths pass every answer through these same functions. No I/O: each function decides from a
status, headers and at most a few bytes of the body.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urljoin, urlsplit

import aiohttp

from shardsync.errors import (
    AuthError,
    EntryNotFoundError,
    OriginError,
    ProtocolError,
    RepoNotFoundError,
    RevisionNotFoundError,
    StalledError,
    TransferError,
    redact,
)
from shardsync.fetch.request import Header, Validator, redact_url
from shardsync.ranges import (
    format_range,
    is_strong_etag,
    parse_content_range,
    parse_unsatisfied_range,
)
from shardsync.retry import classify_status, parse_retry_after

__all__ = [
    "ERROR_BODY",
    "MAX_REDIRECTS",
    "REDIRECTS",
    "TRANSIENT",
    "Bound",
    "Relocate",
    "Restart",
    "RetryLater",
    "check_encoding",
    "check_range_answer",
    "check_whole_answer",
    "describe",
    "error_message",
    "follow",
    "int_or_none",
    "is_retryable_exception",
    "malformed",
    "next_page",
    "opaque_tag",
    "proxy_refused",
    "range_headers",
    "retry_cause",
    "status_error",
    "unquote_etag",
]

REDIRECTS = frozenset({301, 302, 303, 307, 308})
MAX_REDIRECTS = 5
ERROR_BODY = 4096  # bytes of an error answer read for its message
_CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization", "x-amz-security-token")
_STORE_CODE = re.compile(rb"<Code>([A-Za-z]{1,64})</Code>")  # an S3 error document's code
# S3's 400s to a signed URL whose session token ran out before the URL did: a URL signed
# afresh (with credentials the SDK has refreshed by then) is the cure, as for a 403
_TOKEN_EXPIRED = frozenset({"ExpiredToken", "TokenRefreshRequired"})

TRANSIENT = (aiohttp.ClientError, OSError, StalledError, ProtocolError)
"""What a failed Range request may raise that a connection's retry loop hands to the
fetcher's backoff, which decides (``is_retryable_exception``) whether another try may help."""


class RetryLater(TransferError):
    """A retryable HTTP status, with the server's Retry-After when it sent one."""

    def __init__(self, message: str, *, after: float | None, status: int) -> None:
        super().__init__(message)
        self.after = after
        self.status = status


class Restart(Exception):
    """The object changed or Range support failed: discard the partial and start over."""

    def __init__(self, reason: str, *, etag: str | None, single_stream: bool) -> None:
        super().__init__(reason)
        self.etag = etag
        self.single_stream = single_stream


class Relocate(Exception):
    """The data URL stopped working (expired signature): ask the origin again."""


class Bound(Protocol):
    """The object a file's Range requests are bound to: its size and the ETag first seen
    (set by the first answer with a strong one when none was known), and ``tag``, the first
    entity tag seen, weak too, for comparing answers (a weak tag binds no request, but
    another one is another object). Answers are checked on the event loop and in worker
    threads: ``etag`` and ``tag`` are read and set under ``etag_lock``."""

    size: int
    etag: str | None
    tag: str | None
    etag_lock: threading.Lock


_ROUTE_GONE = frozenset(
    {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN, errno.ENETRESET}
)
"""A route or network gone a moment (an ICMP unreachable, an interface flapping)."""


def is_retryable_exception(exc: BaseException) -> bool:
    """Whether a failed request is worth another attempt.

    Connection drops, truncated bodies and timeouts are; TLS certificate or
    handshake failures, bad URLs and everything else are not.
    """
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLCertVerificationError):
        return False
    if isinstance(exc, OSError) and exc.errno in _ROUTE_GONE:
        return True  # the pump's sockets meet these bare (aiohttp wraps them)
    return isinstance(
        exc,
        aiohttp.ClientPayloadError
        | aiohttp.ClientConnectionError
        | asyncio.TimeoutError
        | ConnectionError
        | socket.gaierror  # a name lookup that failed may succeed in a moment
        | ssl.SSLEOFError,  # the peer dropped a TLS connection
    )


def range_headers(
    headers: Mapping[str, str], start: int, end: int, state: Bound, validator: Validator
) -> dict[str, str]:
    """``headers`` with a Range for bytes ``[start, end)`` of the object first seen: its ETag
    goes in ``validator``, so another object answers 200 (``If-Range``) or 412
    (``If-Match``) instead of its own bytes. ``check_range_answer`` checks the answer."""
    headers = dict(headers)
    headers["Range"] = format_range(start, end - 1)
    if state.etag is not None:
        headers[validator] = state.etag
    return headers


def check_range_answer(
    status: int, header: Header, label: str, state: Bound, start: int, end: int
) -> int:
    """Accept a 206 for ``[start, stop)`` of the object first seen, ``stop <= end``; returns
    ``stop``, where its body ends as file data (a chunked body may run on: the rest is not
    the file's). A 200 or 416 to a Range request means start over (``Restart``), as does a
    changed ETag."""
    if status == 200:
        # Range ignored (same object: fall back to one stream) or If-Range failed (a new
        # object: start over with ranges).
        new_etag = header("ETag")
        raise Restart(
            "200 to a Range request",
            etag=new_etag,
            single_stream=state.etag is None or new_etag == state.etag,
        )
    if status == 416:
        total = parse_unsatisfied_range(header("Content-Range") or "")
        raise Restart(
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
    _same_object(state, header("ETag"), single_stream=False)
    check_encoding(header, label)  # a coded body's length is not the range's
    length = header("Content-Length")
    declared = int_or_none(length)
    if length is not None and (declared is None or declared > cr.end - cr.start + 1):
        # the bytes past the Content-Range's end would be written as file data (a shorter
        # body is a short answer: its bytes are the range's first, the rest asked again)
        raise ProtocolError(
            f"{label}: Content-Length {length[:40]!r} is over the Content-Range's "
            f"{cr.end - cr.start + 1} bytes"
        )
    return cr.end + 1


def check_whole_answer(header: Header, label: str, state: Bound, length: int | None) -> None:
    """Accept a 200 to a whole-file GET only for the object first seen: its size, no coding,
    and its ETag. Without a hash to check (a plain URL), another object's bytes of the same
    size would be published under the first one's record."""
    if length is not None and length != state.size:
        raise ProtocolError(f"{label}: full body of {length} bytes, expected {state.size}")
    check_encoding(header, label)
    _same_object(state, header("ETag"), single_stream=True)


def _same_object(state: Bound, etag: str | None, *, single_stream: bool) -> None:
    """Hold every answer to the entity tag first seen, compared weakly (``W/"v1"`` is
    ``"v1"``); a strong one is kept to bind the requests after it."""
    tag = opaque_tag(etag)
    with state.etag_lock:  # heads are checked on the loop and in wire threads
        if state.tag is not None and tag is not None and tag != state.tag:
            raise Restart("ETag changed", etag=etag, single_stream=single_stream)
        state.tag = state.tag or tag
        if state.etag is None and is_strong_etag(etag):
            state.etag = etag


def opaque_tag(etag: str | None) -> str | None:
    """An entity tag without its weak mark, for weak comparison (RFC 9110, 8.8.3.2)."""
    return None if etag is None else etag.removeprefix("W/")


def check_encoding(header: Header, label: str) -> None:
    """The body is the file's bytes: no content coding, and no transfer coding but
    ``chunked`` (which the reader takes off). ``gzip, chunked`` would leave gzip's bytes."""
    encoding = (header("Content-Encoding") or "identity").lower()
    if encoding not in ("identity", ""):
        raise ProtocolError(f"{label}: server applied Content-Encoding {encoding}")
    transfer = [c.strip() for c in (header("Transfer-Encoding") or "").lower().split(",")]
    if transfer not in ([""], ["chunked"]):
        shown = ", ".join(transfer)[:80]
        raise ProtocolError(f"{label}: server applied Transfer-Encoding {shown}")


def status_error(
    status: int, header: Header, body: bytes, label: str, *, relocatable: bool
) -> Exception:
    """What a non-success answer means: the error to raise (``RetryLater`` when a retry may
    help, ``Relocate`` when a fresh URL may, ``Restart`` when the object changed)."""
    store_code = _STORE_CODE.search(body)
    code = header("X-Error-Code") or (store_code[1].decode() if store_code else "")
    message = error_message(body)
    detail = (
        f"{label}: HTTP {status}{' ' + code if code else ''}{': ' + message if message else ''}"
    )
    if status == 400 and relocatable and code in _TOKEN_EXPIRED:
        return Relocate(detail)
    if code == "InvalidObjectState":  # S3's 403 for an archived object: no fresh URL helps
        return OriginError(f"{detail}: the object is archived; restore it first")
    if code == "RepoNotFound":
        return RepoNotFoundError(detail)
    if code == "RevisionNotFound":
        return RevisionNotFoundError(detail)
    if code == "EntryNotFound":
        return EntryNotFoundError(detail)
    if code == "GatedRepo":
        return AuthError(detail)
    if 200 <= status < 300:  # a success this request cannot use (202, 204): no body to take
        return ProtocolError(f"{detail}: not an answer to this request")
    if status == 407:
        return AuthError(f"{detail}: {proxy_refused(None)}")
    verdict = classify_status(status)
    if verdict == "retry":
        after = parse_retry_after(header("Retry-After"), now=time.time())
        return RetryLater(detail, after=after, status=status)
    if verdict == "restart" and relocatable:
        return Restart(detail, etag=None, single_stream=False)
    if verdict == "relocate":
        return Relocate(detail) if relocatable else AuthError(detail)
    if status == 404:
        return EntryNotFoundError(detail)
    return OriginError(detail)


def proxy_refused(sent: bool | None) -> str:
    """What a 407 means, told whether the request carried the proxy URL's credentials."""
    if sent:
        return "the proxy refused the credentials in the proxy URL (HTTP 407): check them"
    if sent is None:
        return (
            "the proxy wants credentials, or refused the ones given (HTTP 407); they go in the "
            "proxy URL, http://USER:PASS@HOST:PORT"
        )
    return "the proxy wants credentials (HTTP 407): give them in the proxy URL, http://USER:PASS@HOST:PORT"


def error_message(body: bytes) -> str:
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


def malformed(exc: aiohttp.ClientResponseError, label: str) -> ProtocolError:
    """aiohttp's parser refused an answer (two lengths, a length beside chunked, a chunk
    whose size lies): the server broke HTTP, as when the pump refuses one. Its message
    quotes the offending bytes and names the URL, query and all: keep the first line."""
    first_line = exc.message.split("\n", 1)[0].rstrip(":")[:200]
    return ProtocolError(f"{label}: malformed answer: {first_line}")


def retry_cause(exc: BaseException) -> str:
    """The name a retry is counted under (``FetchStatistics.retries``)."""
    if isinstance(exc, RetryLater):
        return f"http_{exc.status}"
    if isinstance(exc, StalledError):
        return "stalled"
    if isinstance(exc, ProtocolError):
        return "protocol"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "connection"


def describe(exc: BaseException) -> str:
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


# ---------------------------------------------------------------------- where an answer leads


def _origin_of(url: str) -> tuple[str, str, int | None]:
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # "http://h:99999/", "http://[::1/": a server's Location or Link
        raise ProtocolError(f"a malformed URL from the server: {redact_url(url)}") from None
    if "@" in parts.netloc:  # credentials of its own: aiohttp refuses them beside ours
        raise ProtocolError(
            f"refusing a URL with user:password@ from the server: {redact_url(url)}"
        )
    return parts.scheme, (parts.hostname or "").lower(), port


def follow(url: str, headers: dict[str, str], location: str | None) -> tuple[str, dict[str, str]]:
    """Resolve a redirect; drop credentials when it leaves the origin; refuse https->http."""
    if not location:
        raise ProtocolError(f"redirect without Location from {redact_url(url)}")
    try:
        target = urljoin(url, location)
    except ValueError:
        raise ProtocolError(f"a malformed redirect Location from {redact_url(url)}") from None
    old, new = _origin_of(url), _origin_of(target)
    if new[0] not in ("http", "https"):
        raise ProtocolError(f"refusing redirect to {new[0]!r} URL")
    if old[0] == "https" and new[0] == "http":
        raise ProtocolError(f"refusing https -> http redirect to {redact_url(target)}")
    if old != new:
        headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIAL_HEADERS}
    return target, headers


def next_page(url: str, resp: aiohttp.ClientResponse, label: str) -> str | None:
    """The next page of a listing (``Link: <...>; rel="next"``), on the same origin only."""
    link = resp.links.get("next")
    if link is None:
        return None
    target = urljoin(str(resp.url), str(link["url"]))
    if _origin_of(target) != _origin_of(url):
        raise ProtocolError(
            f"{label}: refusing a next page on another origin: {redact_url(target)}"
        )
    return target


def unquote_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.removeprefix("W/")
    return value.strip('"') or None


def int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
