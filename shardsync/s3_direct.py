"""S3 reads without botocore's client: listings, ``HEAD``s, object attributes, small GETs
and presigned GETs, sent on an aiohttp session and signed by ``s3_sigv4``.

Importing botocore and making its S3 client took 0.19 s of every ``s3://`` run's start
before its first request (bench/README.md). It is used only where everything botocore would
resolve is known without it (``direct_target``): an endpoint and a region named by the
``[s3]`` section or the standard variables, and credentials in the environment. Everything
else (profiles, instance roles, AWS's own endpoints, unsigned reads, uploads) stays with
botocore, through ``S3Client``, which maps this module's refusals as it maps botocore's.
"""

from __future__ import annotations

import contextlib
import ipaddress
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_plus, urlsplit

import aiohttp
from yarl import URL

from shardsync.errors import OriginError, ProtocolError, TransferError
from shardsync.network import NetworkConfig, S3Config, ssl_context
from shardsync.s3_sigv4 import Credentials, presign, sign

__all__ = ["DirectReads", "DirectTarget", "StoreRefused", "direct_target"]

_MAX_ANSWER = 16 << 20  # a listing page of 1000 keys is ~0.3 MB; attributes far less
_ERROR_BODY = 64 << 10
_CHECKSUM_HEADERS = {
    "x-amz-checksum-crc64nvme": "ChecksumCRC64NVME",
    "x-amz-checksum-crc32": "ChecksumCRC32",
    "x-amz-checksum-crc32c": "ChecksumCRC32C",
    "x-amz-checksum-sha1": "ChecksumSHA1",
    "x-amz-checksum-sha256": "ChecksumSHA256",
    "x-amz-checksum-type": "ChecksumType",
}
_CONNECT_S, _READ_S = 10.0, 60.0  # botocore's, as the client had


class StoreRefused(Exception):
    """A store's answer other than success: its status and error code (``"404"`` for a
    ``HEAD``, which has no body), as botocore's ``ClientError`` carries them."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"HTTP {status} {code}")
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class DirectTarget:
    """Where and as whom reads go, as botocore would resolve it from the same settings."""

    endpoint: str  # scheme://host[:port][/path], no trailing slash
    region: str
    path_style: bool
    credentials: Credentials
    requester_pays: bool = False


def direct_target(config: S3Config, environ: Mapping[str, str]) -> DirectTarget | None:
    """The target botocore would read, or None where only botocore can tell (a profile, a
    config file that may name a region, credentials outside the environment, AWS's own
    hosts, a CA bundle only botocore reads, host-style addressing it would choose)."""
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if config.profile or not key or not secret or environ.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    endpoint = config.endpoint
    if endpoint is None and environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() not in (
        "true",
        "1",
    ):
        endpoint = environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query:
        return None
    if parts.scheme == "https" and environ.get("AWS_CA_BUNDLE"):
        return None  # botocore would trust that bundle alone
    region = config.region or environ.get("AWS_DEFAULT_REGION")
    if region is None:
        config_file = environ.get("AWS_CONFIG_FILE") or "~/.aws/config"
        if Path(config_file).expanduser().exists():
            return None  # its profile may name one
        region = "us-east-1"  # botocore's signing region for an endpoint with none
    if config.addressing == "auto" and not _is_ip(parts.hostname):
        return None  # botocore's rules pick the host style by bucket and endpoint
    token = environ.get("AWS_SESSION_TOKEN") or environ.get("AWS_SECURITY_TOKEN") or None
    return DirectTarget(
        endpoint=endpoint.rstrip("/"),
        region=region,
        path_style=config.addressing != "virtual",
        credentials=Credentials(key, secret, token),
        requester_pays=config.requester_pays,
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class DirectReads:
    """Signed reads of one target on a pooled session of its own (opened on first use).

    A store that answers "wrong region" with the bucket's own (``x-amz-bucket-region``, or
    ``<Region>`` in the error) is asked again signed for that region, which is remembered
    for the bucket, presigned URLs included. Transport failures are ``TransferError``;
    other answers ``StoreRefused``."""

    def __init__(
        self,
        target: DirectTarget,
        network: NetworkConfig,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.target = target
        self._network = network
        self._clock = clock
        self._http: aiohttp.ClientSession | None = None
        self.regions: dict[str, str] = {}  # bucket -> the region it answered it lives in

    def _open(self) -> aiohttp.ClientSession:
        if self._http is None:
            # aiohttp's own verified context (the system store) unless a bundle is configured
            ssl: Any = True if self._network.ca_bundle is None else ssl_context(self._network)
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=_CONNECT_S, sock_connect=_CONNECT_S, sock_read=_READ_S
                ),
            )
        return self._http

    async def aclose(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()

    def _through(self, url: str, headers: dict[str, str]) -> dict[str, Any]:
        """The proxy our rules choose for ``url`` (``NO_PROXY`` with CIDRs), its credentials
        in the request to an http URL (which goes to the proxy itself), in the CONNECT else."""
        proxy = self._network.proxy_for(url)
        if proxy is None:
            return {}
        if proxy.username is None:
            return {"proxy": proxy.url}
        auth = aiohttp.encode_basic_auth(proxy.username, proxy.password or "")
        if urlsplit(url).scheme == "http":
            headers["Proxy-Authorization"] = auth
            return {"proxy": proxy.url}
        return {"proxy": proxy.url, "proxy_headers": {"Proxy-Authorization": auth}}

    def object_url(self, bucket: str, key: str = "", query: str = "") -> str:
        target = self.target
        path = quote(key, safe="/~")
        if target.path_style:
            url = f"{target.endpoint}/{quote(bucket, safe='')}/{path}"
        else:
            parts = urlsplit(target.endpoint)
            url = f"{parts.scheme}://{bucket}.{parts.netloc}{parts.path}/{path}"
        return f"{url}?{query}" if query else url

    def presign_get(self, bucket: str, key: str, *, expires: int) -> tuple[str, dict[str, str]]:
        """A GET URL valid ``expires`` seconds, and the headers each request of it sends."""
        headers = self._payer()
        url = presign(
            self.object_url(bucket, key),
            self.target.credentials,
            self.regions.get(bucket, self.target.region),
            self._clock(),
            expires=expires,
            headers=headers,
        )
        return url, headers

    async def list_page(
        self, bucket: str, prefix: str, token: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """One page of ``ListObjectsV2`` (keys URL-encoded on the wire, as botocore asks):
        its objects as botocore's ``Contents`` entries, and the next page's token."""
        query = f"list-type=2&encoding-type=url&prefix={_q(prefix)}"
        if token is not None:
            query += f"&continuation-token={_q(token)}"
        _, body = await self._send("GET", bucket, "", query, {})
        root = _xml(body, bucket)
        found: list[dict[str, Any]] = []
        for entry in _children(root, "Contents"):
            found.append(
                {
                    "Key": unquote_plus(_text(entry, "Key") or ""),
                    "Size": _number(entry, "Size", bucket),
                    "ETag": _text(entry, "ETag") or "",
                    "ChecksumAlgorithm": [
                        c.text or "" for c in _children(entry, "ChecksumAlgorithm")
                    ],
                    "ChecksumType": _text(entry, "ChecksumType") or "FULL_OBJECT",
                }
            )
        following = _text(root, "NextContinuationToken")
        truncated = (_text(root, "IsTruncated") or "").lower() == "true"
        if truncated and not following:
            raise ProtocolError(f"s3://{bucket}/{prefix}: a truncated listing with no next page")
        return found, following if truncated else None

    async def head_object(
        self,
        bucket: str,
        key: str,
        *,
        checksum: bool = False,
        part: int | None = None,
        if_match: str | None = None,
    ) -> dict[str, Any]:
        """What a ``HEAD`` says, under botocore's names (``ContentLength``, ``ETag``,
        ``ChecksumCRC32``, ...)."""
        headers = {"x-amz-checksum-mode": "ENABLED"} if checksum else {}
        if if_match is not None:
            headers["If-Match"] = if_match
        query = f"partNumber={part}" if part is not None else ""
        answer, _ = await self._send("HEAD", bucket, key, query, headers)
        try:
            size = int(answer.get("content-length", ""))
        except ValueError:
            raise ProtocolError(f"s3://{bucket}/{key}: a HEAD without a size") from None
        out: dict[str, Any] = {"ContentLength": size, "ETag": answer.get("etag", "")}
        for header, name in _CHECKSUM_HEADERS.items():
            if header in answer:
                out[name] = answer[header]
        return out

    async def get_object_attributes(
        self, bucket: str, key: str, marker: int, *, max_parts: int
    ) -> dict[str, Any]:
        """``GetObjectAttributes`` for its ``ETag`` and ``ObjectParts``, shaped as botocore's."""
        headers = {
            "x-amz-object-attributes": "ETag,ObjectParts",
            "x-amz-max-parts": str(max_parts),
            "x-amz-part-number-marker": str(marker),
        }
        _, body = await self._send("GET", bucket, key, "attributes", headers)
        where = f"{bucket}/{key}"
        root = _xml(body, where)
        out: dict[str, Any] = {}
        etag = _text(root, "ETag")
        if etag is not None:
            out["ETag"] = etag
        parts = next(iter(_children(root, "ObjectParts")), None)
        if parts is not None:
            out["ObjectParts"] = {
                "Parts": [{"Size": _number(p, "Size", where)} for p in _children(parts, "Part")],
                "IsTruncated": (_text(parts, "IsTruncated") or "").lower() == "true",
                "NextPartNumberMarker": int(_text(parts, "NextPartNumberMarker") or 0),
            }
        return out

    async def get_object(self, bucket: str, key: str, *, max_size: int) -> tuple[bytes, str]:
        """A small object's bytes and ETag; larger ones are refused."""
        answer, body = await self._send("GET", bucket, key, "", {}, limit=max_size)
        return body, answer.get("etag", "")

    def _payer(self) -> dict[str, str]:
        return {"x-amz-request-payer": "requester"} if self.target.requester_pays else {}

    async def _send(
        self,
        method: str,
        bucket: str,
        key: str,
        query: str,
        headers: dict[str, str],
        *,
        limit: int = _MAX_ANSWER,
    ) -> tuple[Mapping[str, str], bytes]:
        """One signed request, asked again once for the bucket's own region where the store
        names another; its headers (names in lower case) and body (at most ``limit`` bytes)."""
        where = f"s3://{bucket}/{key}"
        for _ in range(2):
            region = self.regions.get(bucket, self.target.region)
            url = self.object_url(bucket, key, query)
            signed = sign(
                method,
                url,
                {**headers, **self._payer()},
                self.target.credentials,
                region,
                self._clock(),
            )
            try:
                status, answer, body = await self._exchange(method, url, signed, limit, where)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                if isinstance(exc, aiohttp.ClientHttpProxyError) and exc.status == 407:
                    raise StoreRefused(407, "") from None
                raise TransferError(
                    f"{where}: cannot reach the S3 endpoint ({type(exc).__name__})"
                ) from None
            if 200 <= status < 300:
                return answer, body
            code, named = _error_of(body, status)
            home = answer.get("x-amz-bucket-region") or named
            if status in (301, 400) and home and home != region:
                self.regions[bucket] = home
                continue
            raise StoreRefused(status, code)
        raise OriginError(f"{where}: the store keeps naming another region")

    async def _exchange(
        self, method: str, url: str, headers: dict[str, str], limit: int, where: str
    ) -> tuple[int, Mapping[str, str], bytes]:
        sent = {"Accept-Encoding": "identity", "User-Agent": "shardsync/0.1"}
        sent.update(self._network.extra_headers(url))
        sent.update(headers)
        async with self._open().request(
            method, URL(url, encoded=True), allow_redirects=False,
            **self._through(url, sent), headers=sent,
        ) as resp:  # fmt: skip
            answer = {k.lower(): v for k, v in resp.headers.items()}
            if method == "HEAD":
                return resp.status, answer, b""
            ok = 200 <= resp.status < 300
            if ok and int(answer.get("content-length") or 0) > limit:
                raise OriginError(f"{where}: larger than {limit} bytes")
            cap, body = limit if ok else _ERROR_BODY, bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                if ok and len(body) > limit:
                    raise OriginError(f"{where}: larger than {limit} bytes")
                if not ok and len(body) >= cap:  # an error's first words are enough
                    break
            return resp.status, answer, bytes(body)


def _q(value: str) -> str:
    return quote(value, safe="-_.~")


def _error_of(body: bytes, status: int) -> tuple[str, str | None]:
    """An error answer's code and the region it names; a body-less one's code is its
    status, as botocore makes it."""
    with contextlib.suppress(ET.ParseError, ValueError):
        root = ET.fromstring(body)
        return _text(root, "Code") or str(status), _text(root, "Region")
    return str(status), None


def _xml(body: bytes, where: str) -> ET.Element:
    try:
        return ET.fromstring(body)
    except (ET.ParseError, ValueError):
        raise ProtocolError(f"s3://{where}: the store's answer is not XML") from None


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _children(node: ET.Element, name: str) -> list[ET.Element]:
    return [child for child in node if _local(child.tag) == name]


def _text(node: ET.Element, name: str) -> str | None:
    found = _children(node, name)
    return None if not found else (found[0].text or "")


def _number(node: ET.Element, name: str, where: str) -> int:
    try:
        return int(_text(node, name) or "")
    except ValueError:
        raise ProtocolError(f"s3://{where}: the store's answer has no {name}") from None
