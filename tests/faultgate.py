"""A fault-injecting reverse proxy on loopback in front of a real S3 store (SeaweedFS).

Every request is recorded as received (``FaultGate.seen``), so a test compares its outputs
with the secrets that really went over the wire, never with guesses. Requests pass through
verbatim, the ``Host`` header included, so the store itself checks the client's SigV4
signature; only GETs of object data (presigned: ``X-Amz-Signature`` in the query) meet
``FaultGate.fault``: an error status, a connection reset, a body cut short, a stall, or a
flipped byte.

SeaweedFS refuses any request carrying a session token it did not issue itself. With an
``Identity`` the gate stands in for the STS side of the store: a request carrying
``X-Amz-Security-Token`` (header or query) must carry that identity's token and a SigV4
signature that verifies with its secret key (the gate checks it, then answers 403
``SignatureDoesNotMatch`` or ``InvalidToken`` as S3 would), and goes on upstream re-signed
without the token. So a real token-bearing presigned URL flows through the client under
test, and a client that signs wrong fails here as it would against AWS.

    async with FaultGate(server.endpoint, identity=...) as gate:
        gate.fault = GateFault("status", 503)
        ...  # point the client's S3 endpoint at gate.endpoint
        assert gate.fired
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal
from urllib.parse import parse_qsl, quote, urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

__all__ = ["FaultGate", "GateFault", "Identity", "Seen"]

FaultKind = Literal["none", "status", "redirect", "reset", "cut", "stall", "flip"]

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-connection",
        "content-length",
    }
)
_AUTH = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<credential>[^,\s]+),\s*"
    r"SignedHeaders=(?P<signed>[^,\s]+),\s*Signature=(?P<signature>[0-9a-f]+)"
)
_TOKEN_HEADER = "x-amz-security-token"
_TOKEN_PARAM = "X-Amz-Security-Token"
_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 500: "InternalError", 503: "SlowDown"}


@dataclass(frozen=True, slots=True)
class GateFault:
    """What the gate does to GETs of object data (``none``: passes them through).

    ``status``: answer ``code`` with an S3 error document, or with ``echo`` (``"text"`` or
    ``"json"``) one quoting the request line, signed query and all (as some proxies and
    stores do). ``redirect``: a 307 back to the very same URL, for ever (a redirect loop).
    ``reset``: a TCP reset before any answer. ``cut``: the store's head, half its body,
    then a reset. ``stall``: the store's head, then nothing until ``stall_s`` passes.
    ``flip``: the store's answer with one body byte inverted (headers stay truthful).
    """

    kind: FaultKind = "none"
    code: int = 0
    echo: Literal["", "text", "json"] = ""
    stall_s: float = 5.0  # the gate lets go sooner when it closes
    key: str = ""  # only GETs whose path ends with this (all when empty)
    error: str = ""  # ``status``: the S3 error code answered (else the status's usual one)
    times: int = 0  # the most requests it answers (0: every one)


@dataclass(frozen=True, slots=True)
class Identity:
    """Temporary credentials the gate accepts in the store's stead (see the module doc)."""

    access_key: str
    secret_key: str
    token: str
    region: str


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as the gate received it, and what became of it."""

    method: str
    target: str  # the raw path and query, as sent
    headers: Mapping[str, str]
    token: str | None  # the session token it carried, if any
    verified: bool | None  # its signature checked by the gate (an Identity's token), else None
    fault: FaultKind  # what the gate did instead of passing it through ("none": nothing)
    status: int  # what the client got (0: a reset before any status)
    at: float = field(default_factory=time.monotonic)  # when the answer was decided

    @property
    def presigned(self) -> bool:
        return "X-Amz-Signature=" in self.target or "Signature=" in self.target


@dataclass(eq=False)
class FaultGate:
    """The proxy; use as ``async with FaultGate(upstream) as gate``."""

    upstream: str
    identity: Identity | None = None
    host: str = "127.0.0.1"
    fault: GateFault = field(default_factory=GateFault)
    seen: list[Seen] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the gate's own failures (a test bug)
    # query keys the gate answers 501 NotImplemented, as a store lacking that call does
    # (``attributes``: GetObjectAttributes)
    refuse: frozenset[str] = frozenset()
    # a status every PUT is answered with instead (a store refusing writes: full, throttling)
    refuse_puts: int = 0
    # part of a path whose HEADs are answered 404, as for an object deleted since it was listed
    gone_at_head: str | None = None
    # (part of a path, seconds): PUTs to such paths wait that long first (a tier slower than
    # the origin)
    slow_puts: tuple[str, float] | None = None
    # that many claim renewals (a PUT to ``claims/`` with ``If-Match``) are taken and never
    # answered (a tier that hangs on one request); each is in ``seen`` as it arrives
    stall_renewals: int = 0
    # each claim's first that many renewals are answered 503 SlowDown (a blip of the tier)
    fail_renewals: int = 0
    _failed_renewals: Counter[str] = field(default_factory=Counter)
    # the store's region: a request signed for another is refused as S3 refuses it (a 400
    # naming this region, in ``x-amz-bucket-region`` and, but for a HEAD, in the body)
    home_region: str | None = None
    # a Requester Pays bucket: a request that does not say the reader pays
    # (``x-amz-request-payer: requester``, or in the query of a signed URL) is refused 403
    requester_pays: bool = False
    # the most GETs of each object (by path) the gate was answering at one time
    most_at_once: dict[str, int] = field(default_factory=dict)
    _at_once: Counter[str] = field(default_factory=Counter)
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _port: int = 0

    async def __aenter__(self) -> FaultGate:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=0.2
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 0).start()
        self._port = int(self._runner.addresses[0][1])
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent", "Accept", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=60),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self._port}"

    @property
    def fired(self) -> int:
        """How many requests the fault answered."""
        return sum(1 for s in self.seen if s.fault != "none")

    def secrets(self) -> set[str]:
        """Everything secret the gate received: each signed URL's query, every signature,
        credential scope and session token (in the query or in headers)."""
        found: set[str] = set()
        for seen in self.seen:
            _, _, query = seen.target.partition("?")
            if seen.presigned:
                found.add(query)
            for key, value in parse_qsl(query, keep_blank_values=True):
                if key in ("X-Amz-Signature", "Signature", _TOKEN_PARAM, "X-Amz-Credential"):
                    found.add(value)
            auth = _AUTH.match(seen.headers.get("authorization", ""))
            if auth is not None:
                found.add(auth["signature"])
            if seen.token:
                found.add(seen.token)
        return found

    # ------------------------------------------------------------------ serving

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        counted = request.method == "GET" and "X-Amz-Signature=" in request.raw_path
        path = request.path
        if counted:
            self._at_once[path] += 1
            self.most_at_once[path] = max(self.most_at_once.get(path, 0), self._at_once[path])
        try:
            return await self._answer(request)
        except Exception as exc:
            self.errors.append(f"{request.method} {request.path}: {exc!r}")
            raise
        finally:
            if counted:
                self._at_once[path] -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        target = request.raw_path
        headers = CIMultiDict(request.headers)
        _, _, query = target.partition("?")
        params = parse_qsl(query, keep_blank_values=True)
        token = dict(params).get(_TOKEN_PARAM) or headers.get(_TOKEN_HEADER)
        verified: bool | None = None
        object_get = request.method == "GET" and any(k == "X-Amz-Signature" for k, _ in params)
        path = target.partition("?")[0]
        fault = self.fault if object_get and path.endswith(self.fault.key) else GateFault()
        if fault.times and self.fired >= fault.times:
            fault = GateFault()

        def record(kind: FaultKind, status: int) -> None:
            self.seen.append(
                Seen(
                    request.method,
                    request.raw_path,
                    {k.lower(): v for k, v in request.headers.items()},
                    token,
                    verified,
                    kind,
                    status,
                )
            )

        if any(k in self.refuse for k, _ in params):
            record("status", 501)
            return _s3_error(501, "NotImplemented", target)
        renewal = request.method == "PUT" and "/claims/" in target and "if-match" in headers
        if renewal and self.stall_renewals > 0:
            self.stall_renewals -= 1
            record("stall", 0)
            await asyncio.sleep(3600)
        if renewal and self._failed_renewals[path] < self.fail_renewals:
            self._failed_renewals[path] += 1
            record("status", 503)
            return _s3_error(503, "SlowDown", target)
        if self.slow_puts and request.method == "PUT" and self.slow_puts[0] in target:
            await asyncio.sleep(self.slow_puts[1])
        if self.gone_at_head and request.method == "HEAD" and self.gone_at_head in target:
            record("status", 404)
            return _s3_error(404, "NoSuchKey", target)
        if self.refuse_puts and request.method == "PUT":
            record("status", self.refuse_puts)
            code = _S3_CODES.get(self.refuse_puts, "Error")
            return _s3_error(self.refuse_puts, code, target)
        if self.requester_pays and not _pays(headers, params):
            record("status", 403)
            return _s3_error(403, "AccessDenied", target)
        signed = _parse(target, headers) if self.home_region else None
        if signed is not None and signed.scope.split("/")[1:2] != [self.home_region]:
            record("status", 400)
            return _wrong_region(request.method, signed.presigned, str(self.home_region), target)
        if token is not None and self.identity is not None:
            verified = token == self.identity.token and _verify(
                request.method, target, headers, self.identity
            )
            if not verified:
                code = "InvalidToken" if token != self.identity.token else "SignatureDoesNotMatch"
                record("none", 403)
                return _s3_error(403, code, target)
            target, headers = _resign(request.method, target, headers, self.identity, self.upstream)
        if fault.kind == "status":
            record("status", fault.code)
            quoted = f"{fault.code} refused: {request.method} {request.raw_path}"
            if fault.echo == "json":
                return web.json_response({"error": quoted}, status=fault.code)
            if fault.echo == "text":
                return web.Response(status=fault.code, text=quoted + "\n")
            code = fault.error or _S3_CODES.get(fault.code, "Error")
            return _s3_error(fault.code, code, target)
        if fault.kind == "redirect":
            record("redirect", 307)
            location = self.endpoint + request.raw_path
            return web.Response(status=307, headers={"Location": location})
        if fault.kind == "reset":
            record("reset", 0)
            _reset(request)
            return web.Response()
        status, up_headers, data = await self._forward(request.method, target, headers, body)
        if fault.kind == "none" or status not in (200, 206) or not data:
            record("none", status)
            if request.method == "HEAD":
                return web.Response(status=status, headers=up_headers)
            return web.Response(status=status, headers=up_headers, body=data)
        record(fault.kind, status)
        if fault.kind == "flip":
            changed = bytearray(data)
            changed[len(changed) // 2] ^= 0xFF
            return web.Response(status=status, headers=up_headers, body=bytes(changed))
        response = web.StreamResponse(status=status, headers=up_headers)
        response.content_length = len(data)
        # a client that gave up first (its read timeout ran out while the gate read the
        # object from the store) has hung up: what the fault would still write goes nowhere
        with contextlib.suppress(ConnectionResetError):
            await response.prepare(request)
            if fault.kind == "cut":
                await response.write(data[: len(data) // 2])
            else:  # stall
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(fault.stall_s):
                        await self._closing.wait()
        _reset(request)
        return response

    async def _forward(
        self, method: str, target: str, headers: CIMultiDict[str], body: bytes
    ) -> tuple[int, CIMultiDict[str], bytes]:
        assert self._session is not None
        sent = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP)
        url = URL(self.upstream.rstrip("/") + target, encoded=True)
        async with self._session.request(
            method,
            url,
            headers=sent,
            data=io.BytesIO(body) if body else None,
            allow_redirects=False,
        ) as up:
            data = await up.read()
            back = CIMultiDict(
                (k, v) for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP
            )
            if method == "HEAD" and "Content-Length" in up.headers:
                back["Content-Length"] = up.headers["Content-Length"]
            return up.status, back, data


def _pays(headers: CIMultiDict[str], params: list[tuple[str, str]]) -> bool:
    """Whether a request says the reader pays, as S3 reads it: the header, or for a signed
    URL the query parameter."""
    said = headers.get("x-amz-request-payer") or dict(params).get("x-amz-request-payer")
    return (said or "").lower() == "requester"


def _reset(request: web.BaseRequest) -> None:
    """Close the client's connection with a TCP reset (``SO_LINGER`` 0), not a FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _s3_error(status: int, code: str, target: str, more: str = "") -> web.Response:
    resource = target.partition("?")[0]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the fault gate</Message>{more}"
        f"<Resource>{resource}</Resource><RequestId>FAULTGATE</RequestId></Error>"
    )
    return web.Response(status=status, text=body, content_type="application/xml")


def _wrong_region(method: str, presigned: bool, region: str, target: str) -> web.Response:
    """S3's answer to a signature scoped to another region than the bucket's."""
    if method == "HEAD":
        return web.Response(status=400, headers={"x-amz-bucket-region": region})
    code = "AuthorizationQueryParametersError" if presigned else "AuthorizationHeaderMalformed"
    answer = _s3_error(400, code, target, f"<Region>{region}</Region>")
    answer.headers["x-amz-bucket-region"] = region
    return answer


# ---------------------------------------------------------------------- SigV4


def _quote(value: str) -> str:
    return quote(value, safe="-_.~")


def _canonical_query(params: list[tuple[str, str]]) -> str:
    return "&".join(f"{k}={v}" for k, v in sorted((_quote(k), _quote(v)) for k, v in params))


def _signature(
    secret_key: str,
    method: str,
    path: str,
    params: list[tuple[str, str]],
    headers: Mapping[str, str],
    signed: list[str],
    payload: str,
    amz_date: str,
    scope: str,
) -> str:
    """SigV4 for service s3 (the path as sent: S3 does not normalize it)."""
    canonical = "\n".join(
        [
            method,
            path or "/",
            _canonical_query(params),
            "".join(f"{name}:{' '.join(headers.get(name, '').split())}\n" for name in signed),
            ";".join(signed),
            payload,
        ]
    )
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{digest}"
    day, region, service, _ = scope.split("/")
    key = ("AWS4" + secret_key).encode()
    for part in (day, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class _Signed:
    """A request's SigV4 parts, from its query (presigned) or its Authorization header."""

    presigned: bool
    path: str
    params: list[tuple[str, str]]  # without X-Amz-Signature
    headers: dict[str, str]  # lower-case names
    signed: list[str]
    signature: str
    access_key: str
    scope: str
    amz_date: str
    payload: str


def _parse(target: str, headers: CIMultiDict[str]) -> _Signed | None:
    path, _, query = target.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    lower = {k.lower(): v for k, v in headers.items()}
    values = dict(params)
    if "X-Amz-Signature" in values:
        access_key, _, scope = values.get("X-Amz-Credential", "").partition("/")
        return _Signed(
            presigned=True,
            path=path,
            params=[(k, v) for k, v in params if k != "X-Amz-Signature"],
            headers=lower,
            signed=values.get("X-Amz-SignedHeaders", "host").split(";"),
            signature=values["X-Amz-Signature"],
            access_key=access_key,
            scope=scope,
            amz_date=values.get("X-Amz-Date", ""),
            payload="UNSIGNED-PAYLOAD",
        )
    auth = _AUTH.match(lower.get("authorization", ""))
    if auth is None:
        return None
    access_key, _, scope = auth["credential"].partition("/")
    return _Signed(
        presigned=False,
        path=path,
        params=params,
        headers=lower,
        signed=auth["signed"].split(";"),
        signature=auth["signature"],
        access_key=access_key,
        scope=scope,
        amz_date=lower.get("x-amz-date", ""),
        payload=lower.get("x-amz-content-sha256", "UNSIGNED-PAYLOAD"),
    )


def _sign(parts: _Signed, method: str, secret_key: str) -> str:
    return _signature(
        secret_key,
        method,
        parts.path,
        parts.params,
        parts.headers,
        parts.signed,
        parts.payload,
        parts.amz_date,
        parts.scope,
    )


def _verify(method: str, target: str, headers: CIMultiDict[str], identity: Identity) -> bool:
    parts = _parse(target, headers)
    if parts is None or parts.access_key != identity.access_key or parts.scope.count("/") != 3:
        return False
    return hmac.compare_digest(_sign(parts, method, identity.secret_key), parts.signature)


def _resign(
    method: str, target: str, headers: CIMultiDict[str], identity: Identity, upstream: str
) -> tuple[str, CIMultiDict[str]]:
    """The request for ``upstream`` without its session token, signed again with the same
    key, scope and date (the store knows the key; the token was ours to check)."""
    parts = _parse(target, headers)
    assert parts is not None
    host = urlsplit(upstream).netloc
    lower = {**parts.headers, "host": host}
    lower.pop(_TOKEN_HEADER, None)
    params = [(k, v) for k, v in parts.params if k != _TOKEN_PARAM]
    signed = [name for name in parts.signed if name != _TOKEN_HEADER]
    again = _Signed(
        parts.presigned,
        parts.path,
        params,
        lower,
        signed,
        "",
        parts.access_key,
        parts.scope,
        parts.amz_date,
        parts.payload,
    )
    signature = _sign(again, method, identity.secret_key)
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() != _TOKEN_HEADER)
    out["Host"] = host
    if parts.presigned:
        params.append(("X-Amz-Signature", signature))
        query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in params)
        return f"{parts.path}?{query}", out
    credential = f"{parts.access_key}/{parts.scope}"
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credential}, SignedHeaders={';'.join(signed)}, "
        f"Signature={signature}"
    )
    return target, out
