"""AWS Signature Version 4 for S3 reads: a request's headers, or a presigned URL. Pure.

Written here instead of taken from ``botocore.auth`` because importing that module (and
``awscrt`` and ``urllib3`` with it) cost 65 ms of an ``s3://`` run's start; the tests check
every signature against botocore's for the same request and clock.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import parse_qsl, quote, urlsplit

__all__ = ["EMPTY_SHA256", "Credentials", "presign", "sign"]

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_ALGORITHM = "AWS4-HMAC-SHA256"
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)
    token: str | None = field(default=None, repr=False)


def sign(
    method: str,
    url: str,
    headers: Mapping[str, str],
    credentials: Credentials,
    region: str,
    now: datetime,
) -> dict[str, str]:
    """The headers to send: ``headers`` (lower-case ``x-amz-*`` ones are signed, with the
    host), the date, the empty body's hash and ``Authorization``. ``url`` is sent as is, so
    its path and query must already be percent-encoded as S3 reads them (``object_url``)."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    out = {k.lower(): v for k, v in headers.items()}
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = EMPTY_SHA256
    if credentials.token is not None:
        out["x-amz-security-token"] = credentials.token
    signed = {name: value for name, value in out.items() if name.startswith("x-amz-")}
    signed["host"] = _host(url)
    scope = _scope(now, region)
    signature = _signature(method, url, signed, EMPTY_SHA256, credentials, scope, amz_date)
    out["authorization"] = (
        f"{_ALGORITHM} Credential={credentials.access_key}/{scope}, "
        f"SignedHeaders={';'.join(sorted(signed))}, Signature={signature}"
    )
    return out


def presign(
    url: str,
    credentials: Credentials,
    region: str,
    now: datetime,
    *,
    expires: int,
    headers: Mapping[str, str] | None = None,
) -> str:
    """``url`` as a GET anyone may send for ``expires`` seconds, with ``headers`` (which each
    request must then send) signed into it."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    scope = _scope(now, region)
    signed = {k.lower(): v for k, v in (headers or {}).items()}
    signed["host"] = _host(url)
    params = [
        ("X-Amz-Algorithm", _ALGORITHM),
        ("X-Amz-Credential", f"{credentials.access_key}/{scope}"),
        ("X-Amz-Date", amz_date),
        ("X-Amz-Expires", str(expires)),
        ("X-Amz-SignedHeaders", ";".join(sorted(signed))),
    ]
    if credentials.token is not None:
        params.append(("X-Amz-Security-Token", credentials.token))
    query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in params)
    base, _, existing = url.partition("?")
    unsigned = f"{base}?{existing + '&' if existing else ''}{query}"
    signature = _signature(
        "GET", unsigned, signed, "UNSIGNED-PAYLOAD", credentials, scope, amz_date
    )
    return f"{unsigned}&X-Amz-Signature={signature}"


def _quote(value: str) -> str:
    return quote(value, safe="-_.~")


def _host(url: str) -> str:
    """The Host header a client sends: the port only where it is not the scheme's own."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    if parts.port is not None and parts.port != _DEFAULT_PORTS.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


def _scope(now: datetime, region: str) -> str:
    return f"{now.strftime('%Y%m%d')}/{region}/s3/aws4_request"


def _signature(
    method: str,
    url: str,
    signed: Mapping[str, str],
    payload: str,
    credentials: Credentials,
    scope: str,
    amz_date: str,
) -> str:
    parts = urlsplit(url)
    params = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{k}={v}" for k, v in sorted((_quote(k), _quote(v)) for k, v in params))
    names = sorted(signed)
    canonical = "\n".join(
        [
            method,
            parts.path or "/",  # as sent: S3 neither normalizes nor encodes it again
            query,
            "".join(f"{name}:{' '.join(signed[name].split())}\n" for name in names),
            ";".join(names),
            payload,
        ]
    )
    to_sign = "\n".join(
        [_ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + credentials.secret_key).encode()
    for part in scope.split("/"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
