"""An S3 prefix (``s3://BUCKET/PREFIX/``) holding a checkpoint, like an HTTP base URL.

Listing and metadata go through ``shardsync.s3``; the bytes go through the fetcher on a
presigned GET, so several Range requests per file, a resume bound to the object's ETag
(``If-Match``: a replaced object answers 412 and the file restarts) and streaming hashes
work as for every origin. A file is verified against the checksum the store keeps for it
(``ChecksumMode=ENABLED``): its whole-object SHA-256 names it before it downloads; any other
(CRC64NVME, CRC32C, CRC32, SHA-1, whole or composite) is read by the same ``HEAD`` that
pins the ETag, so it belongs to the bytes fetched. ``tofu`` only when the store keeps none.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shardsync.checksums import StoreChecksum
from shardsync.errors import ConfigError, ManifestError, OriginError, raise_first
from shardsync.fetch.request import BlobRequest, Located
from shardsync.manifest import (
    UNSAFE_NAMES,
    Listing,
    RemoteFile,
    is_safe_name,
    leave_out,
    validate_name,
)
from shardsync.names import S3Location, parse_s3_url
from shardsync.network import S3Config
from shardsync.origins.base import Entry, Http, RequestOrigin
from shardsync.records import RepoRef
from shardsync.s3 import ObjectInfo, PreconditionFailed, S3Client

__all__ = ["S3Origin"]

_MAX_KEYS = 100_000
_HEAD_ALL_UP_TO = 256  # objects under a prefix whose checksums are asked one by one ...
_HEAD_LARGE_FROM = 1 << 20  # ... beyond that, only for objects this large
_HEADS_AT_ONCE = 16
_HEAD_FRESH_S = 60.0  # a listing's HEAD answer stands in for a locate's this long
_REPLACED_TRIES = 3  # HEADs of an object replaced again and again before giving up


@dataclass(frozen=True, slots=True, eq=False)
class S3Origin(RequestOrigin):
    """Objects under one prefix; no commit, so snapshots are named by their content."""

    location: S3Location
    client: S3Client = field(repr=False)
    owns_client: bool = field(default=False, repr=False)
    default_revision: str = "main"
    # what the listing's HEADs answered, by key, and when: the first locate of each object
    # soon after takes it instead of asking again (its ETag and checksum came in one answer;
    # a replaced object then answers 412, and the next locate asks afresh)
    _heads: dict[str, tuple[float, ObjectInfo]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def from_url(
        cls, url: str, *, client: S3Client | None = None, config: S3Config | None = None
    ) -> S3Origin:
        location = parse_s3_url(url)
        if client is not None:
            return cls(location=location, client=client)
        return cls(location=location, client=S3Client(config), owns_client=True)

    @property
    def repo(self) -> RepoRef:
        return RepoRef(kind="s3", name=self.location.url)

    async def list_files(self, fetcher: Http, revision: str, *, hidden: bool = False) -> Listing:
        """Every object under the prefix; SHA-256 from the store where it keeps one, and
        the ETag of each object it ``HEAD``s as that object's ``version``."""
        if revision != self.default_revision:
            raise ConfigError("an S3 prefix has no revisions")
        objects = await self.client.list(self.location, max_keys=_MAX_KEYS)
        wanted: list[tuple[str, ObjectInfo]] = []
        unsafe: list[str] = []
        for obj in objects:
            rel = obj.key[len(self.location.prefix) :]
            if not rel or rel.endswith("/"):
                continue  # folder markers
            if not hidden and any(p.startswith(".") for p in rel.split("/")):
                continue  # hidden files, as for a local directory
            if not is_safe_name(rel):
                unsafe.append(rel)  # never a path, nor a key we ask for
                continue
            wanted.append((rel, obj))
        leave_out(unsafe, self.location.url, UNSAFE_NAMES)
        if not wanted:
            raise ManifestError(f"no objects under {self.location.url}")
        limit = asyncio.Semaphore(_HEADS_AT_ONCE)
        # Stores that list checksums say which objects have one; for the others, HEAD every
        # object of a usual checkpoint, or only the large ones of a repo of many files.
        listed = any(o.sha256_listed for _, o in wanted)
        head_all = not listed and len(wanted) <= _HEAD_ALL_UP_TO

        async def describe(path: str, obj: ObjectInfo) -> RemoteFile:
            sha256 = version = None
            if obj.sha256_listed or head_all or (not listed and obj.size >= _HEAD_LARGE_FROM):
                async with limit:
                    head = await self.client.head(self.location.bucket, obj.key)
                if head.size == obj.size:  # else replaced since the listing: ask again later
                    sha256, version = head.sha256, head.etag or None
                self._heads[obj.key] = (time.monotonic(), head)
            return RemoteFile(path=path, size=obj.size, sha256=sha256, version=version)

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(describe(p, o)) for p, o in wanted]
        except BaseExceptionGroup as group:  # the one clear error (an object gone since)
            raise_first(group)
        return Listing(commit=None, files=tuple(t.result() for t in tasks), exhaustive=True)

    def request_for(self, commit: str | None, entry: Entry) -> BlobRequest:
        key = self.location.key_for(validate_name(entry.path))

        async def locate() -> Located:
            listed, head = self._heads.pop(key, (0.0, None))
            fresh = time.monotonic() - listed < _HEAD_FRESH_S
            if not fresh or (head is not None and head.size != entry.size):
                head = None
            head, checksum = await self._described(key, entry, head)
            url, headers = await self.client.presign_get(self.location.bucket, key)
            return Located(
                url=url,
                headers=headers,
                size=head.size,
                etag=head.etag,
                linked_etag=None,
                commit=None,
                checksum=checksum,
            )

        return BlobRequest(
            url=f"s3://{self.location.bucket}/{key}",
            headers={},
            label=entry.path,
            size=entry.size,
            sha256=entry.sha256,
            locator=locate,
            validator="If-Match",
            connections=self.client.config.connections_per_file,
            chunk_size=self.client.config.chunk_size,
        )

    async def _described(
        self, key: str, entry: Entry, head: ObjectInfo | None
    ) -> tuple[ObjectInfo, StoreChecksum | None]:
        """The object's HEAD (``head``, a fresh listing's, else asked now) and the checksum
        it is checked by, a composite one with its parts' sizes. One replaced between its
        HEAD and its parts is asked again; one whose SHA-256 the listing named, replaced
        since, is an error at once: no byte of the new one can match it."""
        bucket = self.location.bucket
        for _ in range(_REPLACED_TRIES):
            if head is None:
                head = await self.client.head(bucket, key, checksum=entry.sha256 is None)
            if entry.sha256 is not None and entry.version not in (None, head.etag):
                raise OriginError(
                    f"s3://{bucket}/{key}: replaced since it was listed, with the SHA-256 "
                    "named then: run again to list the new one"
                )
            checksum = head.checksum
            if checksum is None or not checksum.composite:
                return head, checksum
            try:
                sizes = await self.client.part_sizes(
                    bucket, key, parts=checksum.parts, etag=head.etag, size=head.size
                )
            except PreconditionFailed:
                head = None  # replaced since its HEAD
                continue
            return head, checksum.with_part_sizes(sizes, head.size)
        raise OriginError(f"s3://{bucket}/{key}: replaced {_REPLACED_TRIES} times as it was read")

    async def version(self, fetcher: Http, entry: Entry) -> str | None:
        key = self.location.key_for(validate_name(entry.path))
        return (await self.client.head(self.location.bucket, key, checksum=False)).etag or None

    async def aclose(self) -> None:
        if self.owns_client:
            await self.client.aclose()
