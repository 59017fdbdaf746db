"""Composite checksums over parts of any size, and objects replaced while they are located,
against a real SeaweedFS on loopback. Every check compares the cache with the bytes put."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from faultgate import FaultGate
from helpers import assert_store_verified, fast_config, put_in_parts, s3, safetensors_bytes

from shardsync.config import Config, S3Config
from shardsync.errors import IntegrityError, OriginError, ProtocolError
from shardsync.origins.s3 import S3Origin
from shardsync.prefetch import prefetch
from shardsync.s3 import S3Client
from shardsync.s3_direct import DirectReads
from shardsync.testing.seaweedfs import S3Server

MiB = 1 << 20
KEY = "parts/model.safetensors"
SOURCE = "parts/"


def config_via(cache: Path, server: S3Server, gate: FaultGate | None = None) -> Config:
    config = fast_config(cache)
    endpoint = server.endpoint if gate is None else gate.endpoint
    s3_config = S3Config(endpoint, server.region, "path", chunk_size=config.fetch.chunk_size)
    return replace(config, s3=s3_config)


def published(result: Any) -> bytes:
    return (result.snapshot_path / "model.safetensors").read_bytes()


async def test_parts_of_unequal_sizes_are_checked_where_attributes_are_refused(
    s3server: S3Server, s3bucket: str, aws_reads: str, tmp_path: Path
) -> None:
    """Parts of 6, 5, 7 and 6 MiB add up as four of 6 MiB would (S3 asks only that each but
    the last be 5 MiB or more). With ``GetObjectAttributes`` refused, first and last part
    took them for equal: the composite was checked at the wrong boundaries and a good object
    failed as corrupt after three downloads. Each part's HEAD tells its size."""
    sizes = (6 * MiB, 5 * MiB, 7 * MiB, 6 * MiB)
    data = safetensors_bytes(b"\x5a", sum(sizes))
    put_in_parts(s3server, s3bucket, KEY, data, sizes, "CRC32")
    async with FaultGate(s3server.endpoint, refuse=frozenset({"attributes"})) as gate:
        config = config_via(tmp_path / "cache", s3server, gate)
        result = await prefetch(f"s3://{s3bucket}/{SOURCE}", config)
    assert gate.fired == 1  # a refusal (501) is not asked again, as botocore would not
    assert published(result) == data
    assert {f.verified for f in result.files} == {"crc32"}
    assert_store_verified(config.cache_dir, {"model.safetensors": data})


def _answers_edited(
    monkeypatch: pytest.MonkeyPatch, operation: str, edit: Callable[[dict[str, Any]], None]
) -> None:
    """Every client's answers to ``operation`` pass through ``edit``: a store that lies,
    to botocore's clients and to ``s3_direct``'s reads alike."""
    opened = S3Client._open

    async def lying(self: S3Client, region: str | None) -> Any:
        client = await opened(self, region)
        client.meta.events.register(f"after-call.s3.{operation}", lambda parsed, **_: edit(parsed))
        return client

    monkeypatch.setattr(S3Client, "_open", lying)
    method = {"HeadObject": "head_object", "GetObjectAttributes": "get_object_attributes"}
    asked = getattr(DirectReads, method[operation])

    async def told(self: DirectReads, *args: Any, **kwargs: Any) -> dict[str, Any]:
        answer: dict[str, Any] = await asked(self, *args, **kwargs)
        edit(answer)
        return answer

    monkeypatch.setattr(DirectReads, method[operation], told)


def one_byte_more(parsed: dict[str, Any]) -> None:
    for part in (parsed.get("ObjectParts") or {}).get("Parts") or ():
        part["Size"] = int(part["Size"]) + 1


def no_etag(parsed: dict[str, Any]) -> None:
    parsed.pop("ETag", None)


def no_end(parsed: dict[str, Any]) -> None:
    parsed["ObjectParts"] = {"IsTruncated": True, "NextPartNumberMarker": 0, "Parts": []}


@pytest.mark.timeout(60)  # a store's pages without end held the job for ever
@pytest.mark.parametrize(
    "lie",
    [one_byte_more, no_etag, no_end],
    ids=["sizes-do-not-add-up", "no-etag", "pages-without-end"],
)
async def test_attributes_a_store_lies_in_are_asked_of_the_parts(
    s3server: S3Server,
    s3bucket: str,
    aws_reads: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    lie: Callable[[dict[str, Any]], None],
) -> None:
    """A store whose ``GetObjectAttributes`` answers part sizes that do not add up to the
    object: the composite it keeps still checks the bytes (the parts' HEADs), where it was
    dropped and the file reported ``tofu``, unchecked. Without the ``ETag`` asked for, the
    object was taken for replaced three times over (an ``OriginError``); a truncated page
    that lists nothing and does not move on was asked again for ever."""
    sizes = (5 * MiB, 5 * MiB, MiB)
    data = safetensors_bytes(b"\xa5", sum(sizes))
    put_in_parts(s3server, s3bucket, KEY, data, sizes, "CRC32")
    _answers_edited(monkeypatch, "GetObjectAttributes", lie)
    result = await prefetch(f"s3://{s3bucket}/{SOURCE}", config_via(tmp_path / "cache", s3server))
    assert published(result) == data
    assert {f.verified for f in result.files} == {"crc32"}


async def test_an_object_replaced_before_its_parts_are_asked_is_located_again(
    s3server: S3Server,
    s3bucket: str,
    aws_reads: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replaced between its HEAD and its ``GetObjectAttributes`` (which answers another
    ETag): the file is located again and the new object read, where the whole prefetch
    failed on the 412."""
    sizes = (5 * MiB, 5 * MiB, MiB)
    first = safetensors_bytes(b"\x01", sum(sizes))
    second = safetensors_bytes(b"\x02", sum(sizes))
    put_in_parts(s3server, s3bucket, KEY, first, sizes, "CRC32")
    asked = S3Client.part_sizes
    replaced: list[str] = []

    async def replace_first(self: S3Client, bucket: str, key: str, **kw: Any) -> Any:
        if not replaced:
            replaced.append(key)
            put_in_parts(s3server, s3bucket, KEY, second, sizes, "CRC32")
        return await asked(self, bucket, key, **kw)

    monkeypatch.setattr(S3Client, "part_sizes", replace_first)
    result = await prefetch(f"s3://{s3bucket}/{SOURCE}", config_via(tmp_path / "cache", s3server))
    assert replaced == [KEY]
    assert published(result) == second
    assert {f.verified for f in result.files} == {"crc32"}


async def test_an_object_replaced_since_its_sha256_was_listed_fails_before_its_body(
    s3server: S3Server,
    s3bucket: str,
    aws_reads: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listing named the object's SHA-256; replaced (same size) before its download, no
    byte of the new one can match. The HEAD already says so: one clear error naming the
    change, not three full downloads and an ``IntegrityError`` blaming the store."""
    old = safetensors_bytes(b"A", 2 * MiB)
    new = safetensors_bytes(b"B", 2 * MiB)

    def put(data: bytes) -> None:
        digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
        s3(s3server).put_object(Bucket=s3bucket, Key=KEY, Body=data, ChecksumSHA256=digest)

    put(old)
    listed = S3Origin.list_files

    async def list_then_replace(self: S3Origin, *args: Any, **kw: Any) -> Any:
        listing = await listed(self, *args, **kw)
        put(new)
        return listing

    monkeypatch.setattr(S3Origin, "list_files", list_then_replace)
    async with FaultGate(s3server.endpoint) as gate:
        config = config_via(tmp_path / "cache", s3server, gate)
        with pytest.raises(OriginError) as raised:
            await prefetch(f"s3://{s3bucket}/{SOURCE}", config)
        bodies = [seen for seen in gate.seen if seen.method == "GET" and "Signature" in seen.target]
    assert not isinstance(raised.value, IntegrityError)
    assert {seen.status for seen in bodies} <= {412}  # bound to the listed ETag: no byte read
    assert not list(config.cache_dir.glob("hub/*/snapshots/*/model.safetensors"))


async def test_a_checksum_the_store_answers_unreadably_is_its_error_not_tofu(
    s3server: S3Server,
    s3bucket: str,
    aws_reads: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store (or a box on the way) that mangles the checksum it keeps: every file was
    published ``verified=tofu``, nothing checked, as if the store kept none."""
    sizes = (5 * MiB, MiB)
    data = safetensors_bytes(b"\x3c", sum(sizes))
    put_in_parts(s3server, s3bucket, KEY, data, sizes, "CRC32")

    def mangled(parsed: dict[str, Any]) -> None:
        if "ChecksumCRC32" in parsed:
            parsed["ChecksumCRC32"] = parsed["ChecksumCRC32"][1:]

    _answers_edited(monkeypatch, "HeadObject", mangled)
    with pytest.raises(ProtocolError):
        await prefetch(f"s3://{s3bucket}/{SOURCE}", config_via(tmp_path / "cache", s3server))
    assert not list((tmp_path / "cache").glob("store/*/*/*"))
