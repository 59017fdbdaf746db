"""S3 access: list, head, presign, put, conditional put, delete.

The only module that imports aiobotocore. Reads go without it where ``s3_direct`` can
resolve the store as botocore would (an endpoint and credentials from the settings and the
environment): its import and client cost 0.19 s of every run's start. It never streams
large objects itself: an S3 origin (or the shared tier) hands the fetcher a presigned GET,
so S3 downloads get the same Range connections, validated resume and streaming hashes as
every other origin.

Credentials come from the standard AWS chain (environment, ``AWS_PROFILE``, the shared
config and credentials files, instance metadata), with ``[s3]`` overriding endpoint,
region, addressing style and profile. No message built here contains a credential or a
signed URL: errors name the bucket, key, operation and the store's error code only.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import logging
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from shardsync.checksums import StoreChecksum, from_s3_answer, parts_fit
from shardsync.errors import (
    AuthError,
    ConfigError,
    EntryNotFoundError,
    OriginError,
    ProtocolError,
    RepoNotFoundError,
    ShardsyncError,
    TransferError,
    disk_error,
    raise_first,
)
from shardsync.names import S3Location
from shardsync.network import NetworkConfig, S3Config
from shardsync.s3_botocore import presign_for_own_region, requester_pays, session_class
from shardsync.s3_direct import DirectReads, StoreRefused, direct_target

_Client = Any  # aiobotocore's client is typed at run time only

__all__ = [
    "MAX_SINGLE_PUT",
    "ObjectInfo",
    "PreconditionFailed",
    "S3Client",
]

_T = TypeVar("_T")
Sleep = Callable[[float], Awaitable[None]]
log = logging.getLogger(__name__)
MAX_SINGLE_PUT = 5 << 30  # S3's limit for one PutObject; larger objects go multipart
_PART_SIZE = 512 << 20
_DELETE_BATCH = 1000  # S3's most keys per DeleteObjects
_PART_HEADS = 8  # a multipart object's part HEADs side by side, where attributes are refused
_PRESIGN_SECONDS = 3600  # a 403 after expiry makes the fetcher ask for a fresh one
_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
        "403",
        "401",
    }
)
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_PROXY_407 = (
    "the proxy wants credentials, or refused the ones given (HTTP 407); they go in the proxy "
    "URL, http://USER:PASS@HOST:PORT"
)
_CHAIN = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or ~/.aws/credentials"
_PRECONDITION_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})


class PreconditionFailed(OriginError):
    """A conditional request lost (``If-None-Match: *`` on a key that exists, ``If-Match``
    on one that changed): someone else wrote first."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object as the store describes it. ``sha256`` is set only when the store keeps a
    SHA-256 of the whole object (not a multipart composite, which hashes the parts);
    ``checksum`` is the strongest checksum it keeps, of either kind."""

    key: str
    size: int
    etag: str  # as served, quoted
    sha256: str | None = None
    sha256_listed: bool = False  # the listing says a SHA-256 checksum exists (HEAD for it)
    checksum: StoreChecksum | None = None


class S3Client:
    """One aiobotocore client, opened on first use and shared by every caller (plus one
    per other region a bucket turns out to live in, only to presign its GETs).

    ``aclose`` releases it; an unused instance owns nothing, so making one is free.
    A request is tried ``attempts`` times: by botocore, with its backoff (up to 1 s before
    the first retry, doubling), or with ``retry_wait`` given, by us, that many seconds apart
    and only after a failure of the transport or the store (a tier must not cost a job a
    second per request to find it dead).
    """

    def __init__(
        self,
        config: S3Config | None = None,
        network: NetworkConfig | None = None,
        *,
        attempts: int = 4,
        retry_wait: float | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.config = config or S3Config()
        self.network = network or NetworkConfig()
        self.attempts = attempts
        self.retry_wait = retry_wait
        self._sleep = sleep  # what our retries wait with (tests record it)
        self._stack: contextlib.AsyncExitStack | None = None
        self._session: Any = None
        self._unsigned = False  # the chain found no credentials: requests go unsigned
        self._client: _Client | None = None
        self._opening = asyncio.Lock()
        self._regions: dict[str, str] = {}  # bucket -> the region botocore signs it for
        self._regional: dict[str, _Client] = {}  # region -> a client that presigns for it
        self._direct: DirectReads | None = None
        self._direct_known = False  # whether ``direct_target`` was asked

    def _reads(self) -> DirectReads | None:
        """Reads without botocore where the settings allow them (made once)."""
        if not self._direct_known:
            target = direct_target(self.config, os.environ)
            self._direct = None if target is None else DirectReads(target, self.network)
            self._direct_known = True
        return self._direct

    async def _get(self) -> _Client:
        if self._client is not None:
            return self._client
        async with self._opening:
            if self._client is None:
                client = await self._open(self.config.region)
                client.meta.events.register_last("before-endpoint-resolution.s3", self._note_region)
                self._client = client
        return self._client

    async def _for_region(self, region: str) -> _Client:
        """A client of the same session that signs for ``region`` (made once)."""
        async with self._opening:
            if region not in self._regional:
                self._regional[region] = await self._open(region)
        return self._regional[region]

    def _note_region(
        self, builtins: dict[str, Any], params: dict[str, Any], context: dict[str, Any], **_: Any
    ) -> None:
        """Remember the region botocore resolves each bucket's requests for. After a store
        answers "wrong region", botocore sends that bucket's later requests to its own
        region, but still signs presigned URLs for the client's: S3 refuses those (400)."""
        bucket, region = params.get("Bucket"), builtins.get("AWS::Region")
        if context.get("is_presign_request") or not isinstance(bucket, str):
            return
        if isinstance(region, str):
            self._regions[bucket] = region

    async def _open(self, region: str | None) -> _Client:
        # imported here: botocore's import costs ~0.3 s that Hub-only runs never pay
        from aiobotocore.config import AioConfig
        from aiobotocore.session import AioSession
        from botocore import UNSIGNED

        cfg = self.config
        if self._session is None:
            session = AioSession(profile=cfg.profile)
            try:
                found = await session.get_credentials()
            except Exception as exc:
                raise _mapped(exc, "find AWS credentials", "") from None
            self._session, self._unsigned = session, found is None
            if found is None:
                log.info("no AWS credentials found: S3 requests go unsigned (public buckets)")
        session = self._session
        client_config = AioConfig(
            http_session_cls=session_class(self.network),
            proxies={},  # each request's own, by our rules: ``s3_botocore.session_class``
            # SigV4 for presigned URLs too (botocore may pick SigV2 for them); none at all, as
            # `aws --no-sign-request`, when there is nothing to sign with
            signature_version=UNSIGNED if self._unsigned else "s3v4",
            # Bodies carry their SHA-256 in ChecksumSHA256, which the store checks; signing
            # the payload too would make botocore hash each upload again, in the event loop
            # (it does for every http endpoint unless told not to).
            s3={"addressing_style": cfg.addressing, "payload_signing_enabled": False},
            # total_max_attempts counts the first try; botocore's max_attempts does not
            retries={
                "total_max_attempts": self.attempts if self.retry_wait is None else 1,
                "mode": "standard",
            },
            connect_timeout=10,
            read_timeout=60,
            # checksums only where S3 requires them; ours are passed explicitly
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        if self._stack is None:
            self._stack = contextlib.AsyncExitStack()
        try:
            client = await self._stack.enter_async_context(
                session.create_client(
                    "s3",
                    endpoint_url=cfg.endpoint,
                    region_name=region,
                    config=client_config,
                    verify=str(self.network.ca_bundle) if self.network.ca_bundle else None,
                )
            )
        except Exception as exc:
            raise _mapped(exc, "open an S3 client", "") from None
        client.meta.events.register_last(
            "before-endpoint-resolution.s3",
            partial(presign_for_own_region, region=client.meta.region_name),
        )
        if cfg.requester_pays:
            client.meta.events.register("before-parameter-build.s3", requester_pays)
        return client

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        direct, self._direct, self._direct_known = self._direct, None, False
        self._session = None
        if direct is not None:
            await direct.aclose()
        self._regional.clear()
        self._regions.clear()
        if stack is not None:
            await stack.aclose()

    async def _call(self, what: str, where: str, call: Callable[[_Client], Awaitable[_T]]) -> _T:
        client = await self._get()
        return await self._tried(what, where, partial(call, client), botocore=True)

    async def _read(
        self,
        what: str,
        where: str,
        direct: Callable[[DirectReads], Awaitable[_T]],
        call: Callable[[_Client], Awaitable[_T]],
    ) -> _T:
        """A read sent by ``s3_direct`` where it may be (``direct``), else by botocore."""
        reads = self._reads()
        if reads is None:
            return await self._call(what, where, call)
        return await self._tried(what, where, partial(direct, reads), botocore=False)

    async def _tried(
        self, what: str, where: str, attempt: Callable[[], Awaitable[_T]], *, botocore: bool
    ) -> _T:
        """``attempt`` until it succeeds, ``attempts`` times in all where it fails in the
        transport or the store: by botocore's backoff inside (``botocore``), else ours (up to
        1 s before the first retry, doubling), or ``retry_wait`` apart where that is given.
        Our retries of a store's answer (``StoreRefused``) are those botocore's standard mode
        makes; with ``retry_wait`` (the tier), any ``TransferError`` is tried once more."""
        left = 0 if botocore and self.retry_wait is None else self.attempts - 1
        retry = 0
        while True:
            try:
                return await attempt()
            except ShardsyncError as exc:
                error, again = exc, isinstance(exc, TransferError)
            except Exception as exc:
                error = _mapped(
                    exc, what, where, unsigned=self._unsigned, pays=self.config.requester_pays
                )
                if isinstance(exc, StoreRefused):
                    again = exc.transient
                else:
                    again = isinstance(error, TransferError)
            if not left or not again:
                raise error from None
            left -= 1
            wait = self.retry_wait
            await self._sleep(random.uniform(0.0, 2.0**retry) if wait is None else wait)
            retry += 1

    # ------------------------------------------------------------------ reading

    async def list(self, where: S3Location, *, max_keys: int) -> list[ObjectInfo]:
        """Every object under the prefix (recursively), at most ``max_keys``."""
        found: list[ObjectInfo] = []

        def add(obj: dict[str, Any]) -> None:
            if len(found) >= max_keys:
                raise OriginError(f"{where.url}: more than {max_keys} objects")
            algorithms = obj.get("ChecksumAlgorithm") or ()
            found.append(
                ObjectInfo(
                    key=str(obj["Key"]),
                    size=int(obj["Size"]),
                    etag=str(obj.get("ETag", "")),
                    sha256_listed="SHA256" in algorithms
                    and obj.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT",
                )
            )

        direct = self._reads()
        if direct is not None:

            async def pages() -> None:
                found.clear()  # a retry lists from the start
                token: str | None = None
                while True:
                    objects, token = await direct.list_page(where.bucket, where.prefix, token)
                    for obj in objects:
                        add(obj)
                    if token is None:
                        return

            await self._tried("list", where.url, pages, botocore=False)
            return found

        async def run(client: _Client) -> None:
            found.clear()  # a retry lists from the start
            paginator = client.get_paginator("list_objects_v2")
            pages: AsyncIterator[dict[str, Any]] = paginator.paginate(
                Bucket=where.bucket, Prefix=where.prefix
            )
            async for page in pages:
                for obj in page.get("Contents", ()):
                    add(obj)

        await self._call("list", where.url, run)
        return found

    async def head(self, bucket: str, key: str, *, checksum: bool = True) -> ObjectInfo:
        """Size, ETag and (asked with ``ChecksumMode=ENABLED``) the checksum the store keeps."""

        async def run(client: _Client) -> dict[str, Any]:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
            if checksum:
                kwargs["ChecksumMode"] = "ENABLED"
            return dict(await client.head_object(**kwargs))

        def direct(reads: DirectReads) -> Awaitable[dict[str, Any]]:
            return reads.head_object(bucket, key, checksum=checksum)

        answer = await self._read("head", f"s3://{bucket}/{key}", direct, run)
        try:
            kept = from_s3_answer(answer) if checksum else None
        except ValueError as exc:
            raise ProtocolError(f"s3://{bucket}/{key}: {exc}") from None
        return ObjectInfo(
            key=key,
            size=int(answer["ContentLength"]),
            etag=str(answer.get("ETag", "")),
            sha256=_whole_object_sha256(answer),
            checksum=kept,
        )

    async def part_sizes(
        self, bucket: str, key: str, *, parts: int, etag: str, size: int
    ) -> tuple[int, ...]:
        """The sizes of a multipart object's parts, in order, for checking a composite
        checksum: ``GetObjectAttributes`` where the store (and the policy) allows it and its
        sizes add up to ``size``; else a ``HEAD`` of each part, a few at a time (parts need
        not be equal: 6, 5, 7 and 6 MiB add up as four of 6 MiB do). ``etag`` pins the
        object: a replaced one answers 412 (``PreconditionFailed``). Raises ``ShardsyncError``
        when the sizes cannot be learned or the parts do not add up to the object."""
        where = f"s3://{bucket}/{key}"

        async def attributes(ask: Callable[[int], Awaitable[Any]]) -> tuple[int, ...]:
            sizes: builtins.list[int] = []
            marker = 0
            for _ in range(-(-parts // 1000) + 1):  # pages of 1000 parts, and one to spare
                answer = await ask(marker)
                said = answer.get("ETag")  # absent: the attributes are no proof; ask the parts
                if said is not None and _unquoted(str(said)) != _unquoted(etag):
                    raise PreconditionFailed(f"{where}: the object changed")
                listed = answer.get("ObjectParts") or {}
                for part in listed.get("Parts") or ():
                    sizes.append(int(part["Size"]))
                if said is None or not listed.get("IsTruncated") or len(sizes) >= parts:
                    return tuple(sizes) if said is not None else ()
                following = int(listed.get("NextPartNumberMarker") or 0)
                if following <= marker:  # a page that does not move on would never end
                    return ()
                marker = following
            return ()  # more pages than the parts fill: the part HEADs say

        def pages(client: _Client) -> Awaitable[tuple[int, ...]]:
            return attributes(
                lambda marker: client.get_object_attributes(
                    Bucket=bucket,
                    Key=key,
                    ObjectAttributes=["ObjectParts", "ETag"],
                    MaxParts=1000,
                    PartNumberMarker=marker,
                )
            )

        def direct_pages(direct: DirectReads) -> Awaitable[tuple[int, ...]]:
            return attributes(partial(direct.get_object_attributes, bucket, key, max_parts=1000))

        try:
            sizes = await self._read("get attributes", where, direct_pages, pages)
        except PreconditionFailed:
            raise
        except ShardsyncError:  # not implemented, not allowed, or failing: ask the parts
            sizes = ()
        if parts_fit(sizes, parts, size):
            return sizes
        limit = asyncio.Semaphore(_PART_HEADS)

        async def part(client: _Client, number: int) -> int:
            async with limit:
                answer = await client.head_object(
                    Bucket=bucket, Key=key, PartNumber=number, IfMatch=etag
                )
            return int(answer["ContentLength"])

        async def direct_part(direct: DirectReads, number: int) -> int:
            async with limit:
                answer = await direct.head_object(bucket, key, part=number, if_match=etag)
            return int(answer["ContentLength"])

        async def head_part(number: int) -> int:
            return await self._read(
                "head part",
                where,
                partial(direct_part, number=number),
                partial(part, number=number),
            )

        try:
            async with asyncio.TaskGroup() as tg:
                heads = [tg.create_task(head_part(n)) for n in range(1, parts + 1)]
        except BaseExceptionGroup as group:
            raise_first(group)
        sizes = tuple(t.result() for t in heads)
        if not parts_fit(sizes, parts, size):
            raise ProtocolError(
                f"{where}: its {parts} parts hold {sum(sizes)} bytes, the object {size}: "
                "its composite checksum cannot be checked"
            )
        return sizes

    async def presign_get(self, bucket: str, key: str) -> tuple[str, dict[str, str]]:
        """A GET URL that carries its own signature (valid for an hour), signed for the
        bucket's own region once a listing or ``HEAD`` has learned it, and the headers it
        was signed with, which each request of it must send."""
        reads = self._reads()
        if reads is not None:  # signed here: no request, nothing to retry
            return reads.presign_get(bucket, key, expires=_PRESIGN_SECONDS)
        signed = {"x-amz-request-payer": "requester"} if self.config.requester_pays else {}

        async def run(client: _Client) -> str:
            region = self._regions.get(bucket)
            if region is not None and region != client.meta.region_name:
                client = await self._for_region(region)
            return str(
                await client.generate_presigned_url(
                    "get_object",
                    Params={"Bucket": bucket, "Key": key},
                    ExpiresIn=_PRESIGN_SECONDS,
                )
            )

        return await self._call("sign", f"s3://{bucket}/{key}", run), signed

    async def get_small(self, bucket: str, key: str, *, max_size: int) -> tuple[bytes, str]:
        """A small object's bytes and ETag (claims, markers); larger ones are refused."""

        async def run(client: _Client) -> tuple[bytes, str]:
            answer = await client.get_object(Bucket=bucket, Key=key)
            async with answer["Body"] as body:
                if int(answer.get("ContentLength", 0)) > max_size:
                    raise OriginError(f"s3://{bucket}/{key}: larger than {max_size} bytes")
                data = await body.read()
            return bytes(data), str(answer.get("ETag", ""))

        def direct(reads: DirectReads) -> Awaitable[tuple[bytes, str]]:
            return reads.get_object(bucket, key, max_size=max_size)

        return await self._read("get", f"s3://{bucket}/{key}", direct, run)

    # ------------------------------------------------------------------ writing

    async def put_bytes(
        self,
        bucket: str,
        key: str,
        data: bytes,
        *,
        if_none_match: bool = False,
        if_match: str | None = None,
    ) -> str:
        """Write a small object; conditional writes raise ``PreconditionFailed`` on losing."""

        async def run(client: _Client) -> str:
            kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": data}
            if if_none_match:
                kwargs["IfNoneMatch"] = "*"
            if if_match is not None:
                kwargs["IfMatch"] = if_match
            answer = await client.put_object(**kwargs)
            return str(answer.get("ETag", ""))

        return await self._call("put", f"s3://{bucket}/{key}", run)

    async def put_file(self, bucket: str, key: str, path: Path, *, sha256: str, size: int) -> None:
        """Upload a verified file, telling the store its SHA-256 (a store that checks it
        refuses a body that does not match). Multipart above ``MAX_SINGLE_PUT``."""
        if size > MAX_SINGLE_PUT:
            await self._put_multipart(bucket, key, path, size)
            return
        checksum = base64.b64encode(bytes.fromhex(sha256)).decode()

        async def run(client: _Client) -> None:
            with _open_local(path) as body:
                await client.put_object(
                    Bucket=bucket,
                    Key=key,
                    Body=body,
                    ContentLength=size,
                    ChecksumSHA256=checksum,
                )

        await self._call("put", f"s3://{bucket}/{key}", run)

    async def _put_multipart(self, bucket: str, key: str, path: Path, size: int) -> None:
        where = f"s3://{bucket}/{key}"

        async def start(client: _Client) -> str:
            answer = await client.create_multipart_upload(Bucket=bucket, Key=key)
            return str(answer["UploadId"])

        upload_id = await self._call("start upload", where, start)
        try:
            parts: list[dict[str, Any]] = []
            with _open_local(path) as f:
                for number, offset in enumerate(range(0, size, _PART_SIZE), start=1):
                    try:
                        chunk = await asyncio.to_thread(_read_at, f, offset, _PART_SIZE)
                    except OSError as exc:  # ours, not the store's: not a tier gone down
                        raise disk_error(exc, f"read {path}", then="it is not uploaded") from exc

                    async def part(client: _Client, n: int = number, body: bytes = chunk) -> str:
                        answer = await client.upload_part(
                            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n, Body=body
                        )
                        return str(answer["ETag"])

                    etag = await self._call("upload part", where, part)
                    parts.append({"ETag": etag, "PartNumber": number})

            async def complete(client: _Client) -> None:
                await client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )

            await self._call("complete upload", where, complete)
        except BaseException:
            with contextlib.suppress(Exception):

                async def abort(client: _Client) -> None:
                    await client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)

                await self._call("abort upload", where, abort)
            raise

    async def delete(self, bucket: str, key: str) -> None:
        async def run(client: _Client) -> None:
            await client.delete_object(Bucket=bucket, Key=key)

        await self._call("delete", f"s3://{bucket}/{key}", run)

    async def delete_many(self, bucket: str, keys: Sequence[str]) -> None:
        """Delete objects a thousand per request (``DeleteObjects``); one that could not be
        deleted is left (the caller deletes only what may stay)."""
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + _DELETE_BATCH]]

            async def run(client: _Client, objects: list[dict[str, str]] = batch) -> None:
                await client.delete_objects(
                    Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
                )

            await self._call("delete", f"s3://{bucket}/{batch[0]['Key']}", run)


def _unquoted(etag: str) -> str:
    return etag.removeprefix("W/").strip('"')


def _open_local(path: Path) -> BinaryIO:
    """A local file to upload; failing, a ``CacheError`` (the store did nothing wrong)."""
    try:
        return path.open("rb")
    except OSError as exc:
        raise disk_error(exc, f"read {path}", then="it is not uploaded") from exc


def _read_at(f: Any, offset: int, n: int) -> bytes:
    f.seek(offset)
    return bytes(f.read(n))


def _whole_object_sha256(answer: dict[str, Any]) -> str | None:
    """The hex SHA-256 of the whole object, when the store says it has one."""
    value = answer.get("ChecksumSHA256")
    if not isinstance(value, str) or "-" in value:
        return None  # absent, or a composite of the parts
    if answer.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 32 else None


def _mapped(
    exc: Exception, what: str, where: str, *, unsigned: bool = False, pays: bool = True
) -> ShardsyncError:
    """botocore's errors in our tree; the message names the object and the store's code,
    never a credential (botocore puts none in ``Error.Code``/``Message``). ``unsigned``:
    the request went without credentials, so a refusal says where they would come from;
    ``pays``: it said the reader pays, else an AccessDenied names that setting too."""
    target = f"{where}: " if where else ""
    if isinstance(exc, StoreRefused):  # s3_direct's, without botocore's import
        return _refused(exc.code, exc.status, f"{target}S3 {what}", unsigned=False, pays=pays)
    from botocore import exceptions as bx

    if isinstance(exc, bx.NoCredentialsError | bx.PartialCredentialsError):
        return AuthError(f"{target}no AWS credentials found for S3 ({_CHAIN})")
    if isinstance(exc, bx.ProfileNotFound):
        return ConfigError(f"AWS profile not found: {exc.kwargs.get('profile')!r}")
    if isinstance(exc, bx.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return _refused(code, status, f"{target}S3 {what}", unsigned=unsigned, pays=pays)
    if isinstance(exc, bx.ProxyConnectionError) and _status_of(exc.kwargs.get("error")) == 407:
        return AuthError(f"{target}S3 {what} failed: {_PROXY_407}")  # CONNECT refused
    if isinstance(exc, bx.ParamValidationError):
        return ConfigError(f"{target}invalid S3 request: {exc}")
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectionError | bx.HTTPClientError):
        return TransferError(f"{target}cannot reach the S3 endpoint ({type(exc).__name__})")
    if isinstance(exc, bx.BotoCoreError | OSError | asyncio.TimeoutError):
        return TransferError(f"{target}S3 {what} failed ({type(exc).__name__})")
    return OriginError(f"{target}S3 {what} failed ({type(exc).__name__})")


def _refused(
    code: str, status: object, request: str, *, unsigned: bool, pays: bool
) -> ShardsyncError:
    """A store's refusal (its error code and HTTP status) in our tree."""
    codes = {code, str(status)}
    detail = f"{request} failed: HTTP {status} {code}".rstrip()
    if codes & _PRECONDITION_CODES:
        return PreconditionFailed(detail)
    if code == "NoSuchBucket":
        return RepoNotFoundError(detail)
    if codes & _MISSING_CODES:
        return EntryNotFoundError(detail)
    if codes & _AUTH_CODES and unsigned:
        return AuthError(
            f"{detail} (no AWS credentials found, so the request went unsigned: {_CHAIN})"
        )
    if codes & _AUTH_CODES:
        payer = "" if pays or code != "AccessDenied" else "; or set [s3] requester_pays = true"
        return AuthError(
            f"{detail} (the store refused the credentials: check the AWS chain or [s3] "
            f"profile{payer})"
        )
    if status == 407:  # a proxy's answer on a plain-http endpoint
        return AuthError(f"{detail}: {_PROXY_407}")
    if isinstance(status, int) and (status >= 500 or status == 429):
        return TransferError(detail)
    return OriginError(detail)


def _status_of(error: object) -> object:
    """The HTTP status an aiohttp proxy error carries (None for others)."""
    return getattr(error, "status", None)
