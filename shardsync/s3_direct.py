"""S3 reads without botocore's client: listings, ``HEAD``s, object attributes, small GETs
and presigned GETs, sent on an aiohttp session and signed by ``s3_sigv4``.

Importing botocore and making its S3 client took 0.19 s of every ``s3://`` run's start
before its first request (bench/README.md). It is used only where everything botocore would
resolve is known without it (``direct_target``): an endpoint and a region named by the
``[s3]`` section or the standard variables, credentials in the environment, and no AWS
config file to say otherwise. Everything else (profiles, instance roles, AWS's own
endpoints, unsigned reads, uploads) stays with botocore, through ``S3Client``, which maps
this module's refusals as it maps botocore's.
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
_AWS_FILES = (
    ("AWS_CONFIG_FILE", "~/.aws/config"),
    ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
)
_TOKEN_VARIABLES = ("AWS_SECURITY_TOKEN", "AWS_SESSION_TOKEN")
_AWS_HOSTS = (".amazonaws.com", ".amazonaws.com.cn", ".api.aws")
# what botocore's standard retry mode asks again: its transient statuses and error codes
_TRANSIENT_STATUSES = frozenset({500, 502, 503, 504})
_TRANSIENT_CODES = frozenset(
    {
        "RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete", "Throttling",
        "ThrottlingException", "ThrottledException", "RequestThrottledException",
        "TooManyRequestsException", "ProvisionedThroughputExceededException",
        "TransactionInProgressException", "RequestLimitExceeded", "BandwidthLimitExceeded",
        "LimitExceededException", "RequestThrottled", "SlowDown", "EC2ThrottledException",
    }
)  # fmt: skip


class StoreRefused(Exception):
    """A store's answer other than success: its status and error code (``"404"`` for a
    ``HEAD``, which has no body), as botocore's ``ClientError`` carries them."""

    def __init__(self, status: int, code: str) -> None:
        super().__init__(f"HTTP {status} {code}")
        self.status = status
        self.code = code

    @property
    def transient(self) -> bool:
        """Whether botocore's standard retry mode would ask again."""
        return self.status in _TRANSIENT_STATUSES or self.code in _TRANSIENT_CODES


@dataclass(frozen=True, slots=True)
class DirectTarget:
    """Where and as whom reads go, as botocore would resolve it from the same settings."""

    endpoint: str  # scheme://host[:port][/path], no trailing slash; buckets in the path
    region: str
    credentials: Credentials
    requester_pays: bool = False


def direct_target(config: S3Config, environ: Mapping[str, str]) -> DirectTarget | None:
    """The target botocore would read, or None where only botocore can tell: a profile, an
    AWS config or credentials file (either may name a region, a CA bundle, an endpoint
    rule), credentials outside the environment, AWS's own hosts, a CA bundle only botocore
    reads, host-style addressing (botocore picks it per bucket and endpoint)."""
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if config.profile or environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE"):
        return None
    if not key or not secret or environ.get("AWS_CREDENTIAL_EXPIRATION"):
        return None
    for variable, default in _AWS_FILES:
        if Path(environ.get(variable) or default).expanduser().exists():
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
    if parts.hostname.lower().rstrip(".").endswith(_AWS_HOSTS):
        return None  # AWS's own hosts: botocore moves a bucket to its region's host
    # botocore's signing region for an endpoint with none named anywhere
    region = config.region or environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    if config.addressing == "virtual" or (
        config.addressing == "auto" and not _is_ip(parts.hostname)
    ):
        return None  # botocore's rules pick the host style by bucket and endpoint
    # the first of these that is not empty, as botocore's environment provider reads them
    token = next((environ[k] for k in _TOKEN_VARIABLES if environ.get(k)), None)
    return DirectTarget(
        endpoint=endpoint.rstrip("/"),
        region=region,
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
    for the bucket, presigned URLs included. Transport failures are ``TransferError``; a
    store's refusal (and a proxy's 407) ``StoreRefused``; an answer too large, or a store
    that keeps naming other regions, ``OriginError``; an answer no XML, ``ProtocolError``."""

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
            # https: the configured bundle, else the system store as the environment names it
            # now (aiohttp's own context was made as it was imported)
            https = self.target.endpoint.startswith("https:")
            ssl: Any = ssl_context(self._network) if https else True
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
        route = self._network.route(url)
        if route.proxy is None:
            return {}
        headers.update(route.request_headers)
        return {"proxy": route.proxy, "proxy_headers": route.connect_headers or None}

    def object_url(self, bucket: str, key: str = "", query: str = "") -> str:
        url = f"{self.target.endpoint}/{quote(bucket, safe='')}/{quote(key, safe='/~')}"
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
        encoded = (_text(root, "EncodingType") or "").lower() == "url"  # as botocore decodes
        for entry in _children(root, "Contents"):
            key = _text(entry, "Key") or ""
            found.append(
                {
                    "Key": unquote_plus(key) if encoded else key,
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
        if truncated and (not following or following == token):
            raise ProtocolError(f"s3://{bucket}/{prefix}: a listing whose pages do not move on")
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
                "NextPartNumberMarker": _number(parts, "NextPartNumberMarker", where, 0),
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
        # the [network] headers go with the bytes' GETs (the fetcher's), not with API calls,
        # as botocore's never carried them: an x-amz-* one unsigned would be refused
        sent = {"Accept-Encoding": "identity", "User-Agent": "shardsync/0.1", **headers}
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
    with contextlib.suppress(Exception):  # not XML, or XML no parser reads (a bad encoding)
        root = ET.fromstring(body)
        return _text(root, "Code") or str(status), _text(root, "Region")
    return str(status), None


def _xml(body: bytes, where: str) -> ET.Element:
    try:
        return ET.fromstring(body)
    except Exception:  # ParseError, ValueError, LookupError (an unknown encoding), ...
        raise ProtocolError(f"s3://{where}: the store's answer is not XML") from None


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _children(node: ET.Element, name: str) -> list[ET.Element]:
    return [child for child in node if _local(child.tag) == name]


def _text(node: ET.Element, name: str) -> str | None:
    found = _children(node, name)
    return None if not found else (found[0].text or "")


def _number(node: ET.Element, name: str, where: str, default: int | None = None) -> int:
    text = _text(node, name)
    if text is None and default is not None:
        return default
    try:
        return int(text or "")
    except ValueError:
        raise ProtocolError(f"s3://{where}: the store's answer has no {name}") from None
