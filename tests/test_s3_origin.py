"""``s3://BUCKET/PREFIX/`` as a source, against a real SeaweedFS on loopback.

Every check compares what landed in the cache with the bytes put into the store.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, urlsplit

import pytest
from daemons import daemon_in_loop, short_tmp
from faultgate import FaultGate, GateFault
from helpers import (
    OnFileDone,
    assert_snapshot_matches,
    assert_store_verified,
    fast_config,
    s3,
    until,
    upload_as_uploaders_do,
)

from shardsync.cache import CacheStore
from shardsync.client import Client
from shardsync.config import Config, S3Config
from shardsync.errors import (
    AuthError,
    ConfigError,
    DaemonError,
    IntegrityError,
    OriginError,
)
from shardsync.network import network_from_env
from shardsync.prefetch import Engine, prefetch
from shardsync.prune import PruneReport, prune_cache
from shardsync.prune_plan import Limits
from shardsync.records import FileOutcome
from shardsync.s3 import S3Client
from shardsync.testing import Checkpoint, build_checkpoint, serve_in_thread
from shardsync.testing.daemons import DaemonProcess, write_config
from shardsync.testing.relay import Relay, without_fields
from shardsync.testing.seaweedfs import S3Server

PREFIX = "models/tiny"
_T = TypeVar("_T")
Throttle = Callable[[int], float]


@pytest.fixture(scope="module")
def s3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Three shards of ~1 MiB each: several Range requests per shard with `fast_config`."""
    return build_checkpoint(tmp_path_factory.mktemp("s3ck"), total_bytes=3 << 20, n_shards=3)


@pytest.fixture(scope="module")
def s3_multipart_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Two shards of 11 MiB: three parts each at S3's smallest part size (5 MiB)."""
    return build_checkpoint(tmp_path_factory.mktemp("s3mp"), total_bytes=22 << 20, n_shards=2)


def s3_config(cache_dir: Path, server: S3Server, *, through: FaultGate | None = None) -> Config:
    """A config reading ``server``, or the gate in front of it (``through``)."""
    config = fast_config(cache_dir)  # its small ranges for S3 objects too
    endpoint = server.endpoint if through is None else through.endpoint
    s3 = S3Config(endpoint, server.region, "path", chunk_size=config.fetch.chunk_size)
    return replace(config, s3=s3)


def upload(
    server: S3Server, bucket: str, checkpoint: Checkpoint, *, checksums: bool, prefix: str = PREFIX
) -> None:
    """Put every file of the checkpoint under ``prefix``; with ``checksums`` the store keeps
    each object's SHA-256 (as ``aws s3 cp --checksum-algorithm SHA256`` would)."""
    for rel in checkpoint.files:
        put(server, bucket, f"{prefix}/{rel}", checkpoint.path(rel).read_bytes(), checksums)


def put(
    server: S3Server,
    bucket: str,
    key: str,
    data: bytes,
    checksum: bool = False,
) -> None:
    """A blocking PutObject (usable from inside a running event loop, as a fault); with
    ``checksum`` the store keeps the object's SHA-256 (it refuses a body that differs)."""
    kwargs = {}
    if checksum:
        kwargs["ChecksumSHA256"] = base64.b64encode(hashlib.sha256(data).digest()).decode()
    s3(server).put_object(Bucket=bucket, Key=key, Body=data, **kwargs)


def test_prefetch_from_s3_is_byte_exact_and_says_tofu_without_checksums(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    config = s3_config(tmp_path / "cache", s3server)
    result = _run(prefetch(f"s3://{s3bucket}/{PREFIX}/", config))
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    assert_store_verified(config.cache_dir, s3_checkpoint)
    assert {f.verified for f in result.files} == {"tofu"}
    assert {f.path for f in result.files} == set(s3_checkpoint.files)
    assert result.repo.kind == "s3"
    again = _run(prefetch(f"s3://{s3bucket}/{PREFIX}", config))  # no slash: the same prefix
    assert again.snapshot_path == result.snapshot_path
    assert again.bytes_downloaded == 0


def test_store_checksums_verify_every_shard(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    config = s3_config(tmp_path / "cache", s3server)
    result = _run(prefetch(f"s3://{s3bucket}/{PREFIX}/", config))
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    verified = {f.path: f.verified for f in result.files}
    assert {verified[s] for s in s3_checkpoint.shards} == {"sha256"}


async def _on_body_path(
    stack: contextlib.AsyncExitStack, config: Config, via: str
) -> tuple[Config, Relay | None]:
    """``config`` for one body path: "direct" (the fast pump) as is, "proxy" (the aiohttp
    path) through a forward proxy on loopback, entered on ``stack`` and returned too."""
    if via == "direct":
        return config, None
    proxy = await stack.enter_async_context(Relay())
    return replace(config, network=network_from_env({"http_proxy": proxy.url})), proxy


def upload_with(
    server: S3Server, bucket: str, checkpoint: Checkpoint, algorithm: str, *, multipart: bool
) -> None:
    upload_as_uploaders_do(server, bucket, checkpoint, PREFIX, algorithm, multipart=multipart)


@pytest.mark.parametrize(
    ("algorithm", "multipart"),
    [
        ("CRC32", False),
        ("CRC32", True),  # boto3's default for every file above 8 MiB: a composite CRC32
        ("CRC32C", True),
        ("CRC64NVME", False),  # S3's own default
        ("CRC64NVME", True),
        ("SHA1", True),
        ("SHA256", True),  # a composite: the whole object's SHA-256 is not known
    ],
)
def test_each_checksum_a_store_keeps_verifies_the_files(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    algorithm: str,
    multipart: bool,
) -> None:
    checkpoint = s3_multipart_checkpoint if multipart else s3_checkpoint
    upload_with(s3server, s3bucket, checkpoint, algorithm, multipart=multipart)
    config = s3_config(tmp_path / "cache", s3server)
    result = _run(prefetch(f"s3://{s3bucket}/{PREFIX}/", config))
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(config.cache_dir, checkpoint)
    assert {f.verified for f in result.files} == {algorithm.lower()}


@pytest.mark.parametrize("via", ["direct", "proxy"])
@pytest.mark.parametrize("multipart", [False, True])
async def test_a_flipped_byte_in_a_crc_checked_object_is_never_published(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    via: str,
    multipart: bool,
) -> None:
    """Objects as boto3 uploads them by default (CRC32), one byte flipped between the store
    and shardsync in every answer for one shard: that shard fails with an integrity error
    on each body path, and no blob that differs from the store's bytes is ever published."""
    checkpoint = s3_multipart_checkpoint if multipart else s3_checkpoint
    upload_with(s3server, s3bucket, checkpoint, "CRC32", multipart=multipart)
    shard = checkpoint.shards[1]
    async with contextlib.AsyncExitStack() as stack:
        gate = await stack.enter_async_context(FaultGate(s3server.endpoint))
        gate.fault = GateFault("flip", key=f"/{PREFIX}/{shard}")
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        config, proxy = await _on_body_path(stack, config, via)
        with pytest.raises(IntegrityError):
            await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
        if proxy is not None:
            assert proxy.statuses("GET")
    assert gate.fired
    assert_store_verified(config.cache_dir, checkpoint)
    assert not list((config.cache_dir / "other").glob("*/snapshots/*/" + shard))


async def test_composite_parts_are_learned_without_get_object_attributes(
    s3server: S3Server,
    s3bucket: str,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A store (or a policy) that refuses ``GetObjectAttributes``: the parts' sizes come from
    a ``HEAD`` of each part, and the composite still checks every byte."""
    checkpoint = s3_multipart_checkpoint
    upload_with(s3server, s3bucket, checkpoint, "CRC32C", multipart=True)
    async with FaultGate(s3server.endpoint, refuse=frozenset({"attributes"})) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert gate.fired  # the store's refusal was met
    assert any("partNumber=3" in seen.target for seen in gate.seen if seen.method == "HEAD")
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert {f.verified for f in result.files} == {"crc32c"}


async def test_each_object_costs_one_head_and_no_more_round_trips(
    s3server: S3Server,
    s3bucket: str,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """The fixed cost of an S3 source: one listing, one ``HEAD`` per object (its size, ETag
    and checksum, taken by its download too), one ``GetObjectAttributes`` per composite."""
    checkpoint = s3_multipart_checkpoint
    upload_with(s3server, s3bucket, checkpoint, "CRC32", multipart=True)
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    heads = [seen.target.partition("?")[0] for seen in gate.seen if seen.method == "HEAD"]
    assert sorted(heads) == sorted(f"/{s3bucket}/{PREFIX}/{rel}" for rel in checkpoint.files)
    attributes = [seen for seen in gate.seen if "attributes" in seen.target]
    assert len(attributes) == len(checkpoint.shards)


async def test_an_object_gone_between_the_listing_and_its_head_is_one_clear_error(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """The listing HEADs its objects side by side; one deleted since it was listed (here the
    gate answers its HEAD 404) ended the prefetch in a bare ExceptionGroup, a traceback
    from the CLI."""
    from shardsync.errors import ShardsyncError

    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    shard = s3_checkpoint.shards[1]
    async with FaultGate(s3server.endpoint, gone_at_head=f"{PREFIX}/{shard}") as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        with pytest.raises(ShardsyncError) as failed:
            await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert shard in str(failed.value)


async def test_a_cached_model_costs_the_listing_alone_and_a_replaced_object_is_fetched(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """Objects without a SHA-256 (uploaded with boto3's default CRC32, or with none) are
    found in the cache by the ETag their download recorded. The listing's ``HEAD`` of each
    object already says it: a run over a cached model asks the store one listing and one
    ``HEAD`` per object, no more. And that answer is the object as it is: one replaced
    since (same size, new bytes) is downloaded again and its new bytes published."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    source = f"s3://{s3bucket}/{PREFIX}/"
    objects = sorted(f"/{s3bucket}/{PREFIX}/{rel}" for rel in s3_checkpoint.files)
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        await prefetch(source, config)
        gate.seen.clear()
        again = await prefetch(source, config)
        heads = sorted(seen.target.partition("?")[0] for seen in gate.seen if seen.method == "HEAD")
        assert heads == objects
        assert again.bytes_downloaded == 0
        assert_snapshot_matches(again.snapshot_path, s3_checkpoint)
        first = s3_checkpoint.shards[0]
        new = _same_size_other_bytes(s3_checkpoint.path(first).read_bytes())
        await asyncio.to_thread(put, s3server, s3bucket, f"{PREFIX}/{first}", new)
        third = await prefetch(source, config)
    assert (third.snapshot_path / first).read_bytes() == new
    assert third.bytes_downloaded == len(new)
    for rel in s3_checkpoint.files:
        if rel != first:
            assert (third.snapshot_path / rel).read_bytes() == s3_checkpoint.path(rel).read_bytes()


async def test_a_blob_an_s3_job_finds_in_the_store_outlives_a_prune_of_its_other_snapshot(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """Objects with a SHA-256 are found in the store before any byte moves; a snapshot named
    by its content links them only at its end. A prune evicting the other prefix's snapshot,
    which held them, while this job runs leaves them: the job finishes with the origin's
    bytes."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=True, prefix="models/a")
    put(s3server, s3bucket, "models/a/NOTES.md", b"what an eviction of models/a frees")
    upload(s3server, s3bucket, s3_checkpoint, checksums=True, prefix="models/b")
    config = s3_config(tmp_path / "cache", s3server)
    cache = CacheStore(config.cache_dir)
    await prefetch(f"s3://{s3bucket}/models/a/", config)
    pruning = OnFileDone(s3_checkpoint.shards[0], lambda: prune_cache(cache, Limits(max_size=0)))
    result = await prefetch(f"s3://{s3bucket}/models/b/", config, progress=pruning)
    (report,) = pruning.results
    assert isinstance(report, PruneReport)
    assert [e.repo for e in report.evicted] == [f"s3://{s3bucket}/models/a/"]
    sources = {f.path: f.source for f in result.files}
    assert sources[s3_checkpoint.shards[0]] == "cache"  # found in the store, then kept
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)


@pytest.mark.parametrize("client_region", ["us-east-1", None])
async def test_a_bucket_in_another_region_gets_urls_signed_for_its_region(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_reads: str,
    tmp_path: Path,
    client_region: str | None,
) -> None:
    """botocore follows the store's "wrong region" answers for the listing and the HEADs,
    but signs presigned URLs for the client's region, which S3 refuses (400). ``None``: no
    region configured anywhere (botocore's default), the commonest way to meet it."""
    home = "eu-west-1"
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    async with FaultGate(s3server.endpoint, home_region=home) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        config = replace(config, s3=replace(config.s3, region=client_region))
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    assert {f.verified for f in result.files} == {"sha256"}
    gets = [seen for seen in gate.seen if seen.presigned]
    assert gets
    assert all(seen.status in (200, 206) for seen in gets)
    assert all(f"%2F{home}%2Fs3%2F" in seen.target for seen in gets)
    assert any(seen.status == 400 for seen in gate.seen)  # the client did start elsewhere


@pytest.mark.parametrize("via", ["direct", "proxy"])
async def test_a_requester_pays_bucket_is_read_when_the_config_says_so(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_reads: str,
    tmp_path: Path,
    via: str,
) -> None:
    """A Requester Pays bucket refuses (403) every request that does not say the reader
    pays. Without ``[s3] requester_pays`` that is one AuthError and nothing lands; with it
    every request says so: the listing, the HEADs and each Range GET of a presigned URL
    (which signs the header, so the store itself checks it was sent), on each body path."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    source = f"s3://{s3bucket}/{PREFIX}/"
    async with contextlib.AsyncExitStack() as stack:
        gate = await stack.enter_async_context(FaultGate(s3server.endpoint, requester_pays=True))
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        with pytest.raises(AuthError):
            await prefetch(source, config)
        assert not list(config.cache_dir.glob("other/*/snapshots/*/*"))
        refused = len(gate.seen)
        paying = replace(config, s3=replace(config.s3, requester_pays=True))
        paying, proxy = await _on_body_path(stack, paying, via)
        result = await prefetch(source, paying)
        if proxy is not None:
            assert proxy.statuses("GET")
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    assert {f.verified for f in result.files} == {"sha256"}
    paid = gate.seen[refused:]
    assert [seen for seen in paid if seen.presigned]
    assert all(seen.status in (200, 206) for seen in paid)
    assert all(seen.headers.get("x-amz-request-payer") == "requester" for seen in paid)


async def test_configured_headers_go_with_the_bytes_not_with_the_api_calls(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_reads: str, tmp_path: Path
) -> None:
    """``[network] headers`` (a P2P cache's filters) ride on the presigned GETs the fetcher
    sends, through the cache; the listing and HEADs go to the store itself and never carried
    them (botocore's did not)."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        extra = {"127.0.0.1": {"X-Dragonfly-Tag": "m"}}
        config = replace(config, network=replace(config.network, headers=extra))
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    calls = [seen for seen in gate.seen if not seen.presigned]
    assert calls and all("x-dragonfly-tag" not in seen.headers for seen in calls)
    assert all(seen.headers.get("x-dragonfly-tag") == "m" for seen in gate.seen if seen.presigned)


@pytest.mark.parametrize("via", ["direct", "proxy"])
async def test_a_url_whose_session_token_expired_is_signed_again(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    via: str,
) -> None:
    """A URL signed with temporary credentials dies with its token, before its own expiry:
    S3 answers 400 ExpiredToken (not 403). The file signs a fresh URL and goes on, on each
    body path."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    shard = s3_checkpoint.shards[1]
    async with contextlib.AsyncExitStack() as stack:
        gate = await stack.enter_async_context(FaultGate(s3server.endpoint))
        key = f"/{PREFIX}/{shard}"
        gate.fault = GateFault("status", 400, error="ExpiredToken", key=key, times=1)
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        config, proxy = await _on_body_path(stack, config, via)
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
        if proxy is not None:
            assert proxy.statuses("GET")
    assert gate.fired == 1
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    assert result.fetch is not None and result.fetch.retries.get("relocate") == 1


async def test_an_archived_object_fails_at_once_without_new_urls(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """S3 answers a GET of an object in Glacier (or an archive tier) 403 InvalidObjectState:
    unlike an expired URL's 403, signing again cannot help, so the file fails at once."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    shard = s3_checkpoint.shards[1]
    async with FaultGate(s3server.endpoint) as gate:
        key = f"/{PREFIX}/{shard}"
        gate.fault = GateFault("status", 403, error="InvalidObjectState", key=key)
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        with pytest.raises(OriginError) as raised:
            await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert not isinstance(raised.value, AuthError)
    assert 1 <= gate.fired <= config.s3.connections_per_file  # each first look, no more
    assert not list((config.cache_dir / "other").glob("*/snapshots/*/" + shard))


@pytest.mark.parametrize("addressing", ["auto", "path"])
async def test_presigned_urls_point_at_the_buckets_own_region(
    addressing: Literal["auto", "path"], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """AWS's global host refuses buckets in the regions opened since 2019 (me-south-1 here):
    a URL must name the region it is signed for, in its host too. Signing is local."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    client = S3Client(S3Config(region="me-south-1", addressing=addressing))
    try:
        url = urlsplit((await client.presign_get("models-bucket", "llama/model.safetensors"))[0])
    finally:
        await client.aclose()
    credential = dict(parse_qsl(url.query))["X-Amz-Credential"]
    assert credential.split("/")[2] == "me-south-1"
    if addressing == "path":
        assert (url.netloc, url.path) == (
            "s3.me-south-1.amazonaws.com",
            "/models-bucket/llama/model.safetensors",
        )
    else:
        assert (url.netloc, url.path) == (
            "models-bucket.s3.me-south-1.amazonaws.com",
            "/llama/model.safetensors",
        )


@pytest.mark.parametrize("cap", [2, None])
async def test_s3_objects_take_at_most_their_own_connection_cap(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    cap: int | None,
) -> None:
    """``[s3] connections_per_file`` bounds the Range connections of each object below the
    download section's 4; without it, all 4 are used."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        if cap is not None:
            config = replace(config, s3=replace(config.s3, connections_per_file=cap))
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    shards = [gate.most_at_once[f"/{s3bucket}/{PREFIX}/{s}"] for s in s3_checkpoint.shards]
    assert max(shards) == (cap or config.fetch.connections_per_file)


@pytest.mark.parametrize(("s3_chunk", "connections"), [(1 << 20, 4), (4 << 20, 4), (8 << 20, 1)])
async def test_s3_ranges_are_as_large_as_the_s3_section_says(
    s3server: S3Server,
    s3bucket: str,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    s3_chunk: int,
    connections: int,
) -> None:
    """An object store is asked for at most ``[s3] chunk_size`` per Range (fewer requests
    cost the store less), not for the download section's smaller ranges (11 MiB over 4
    connections: 1 MiB ranges, or four of about 2.9 MiB), and its last ranges are not cut
    finer as a CDN's are (over one connection in 8 MiB ranges: two of 5.5 MiB, not one of
    5.5 and two of 2.75)."""
    checkpoint = s3_multipart_checkpoint
    upload(s3server, s3bucket, checkpoint, checksums=True)
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        s3 = replace(config.s3, chunk_size=s3_chunk, connections_per_file=connections)
        config = replace(config, s3=s3)
        result = await prefetch(f"s3://{s3bucket}/{PREFIX}/", config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    ranges: dict[str, list[tuple[int, int]]] = {}
    for seen in gate.seen:
        path = seen.target.partition("?")[0]
        first, dash, last = seen.headers.get("range", "").removeprefix("bytes=").partition("-")
        if seen.method == "GET" and path.endswith(checkpoint.shards):
            assert dash, "every shard is read by Range"
            ranges.setdefault(path, []).append((int(first), int(last) + 1))
    assert len(ranges) == len(checkpoint.shards)
    sizes = [end - start for got in ranges.values() for start, end in got]
    assert sum(sizes) == sum(checkpoint.path(s).stat().st_size for s in checkpoint.shards)
    assert config.fetch.chunk_size < max(sizes) <= s3_chunk
    for got in ranges.values():  # an even split: every range but the last is the same size
        lengths = [end - start for start, end in sorted(got)]
        assert len(set(lengths[:-1])) <= 1 and lengths[-1] <= lengths[0]


def test_load_from_s3_gives_the_exact_tensors(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    import torch
    from safetensors.torch import load_file

    import shardsync

    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    config = s3_config(tmp_path / "cache", s3server)
    tensors = shardsync.load(f"s3://{s3bucket}/{PREFIX}/", config=config, device_map="cpu")
    expected: dict[str, Any] = {}
    for shard in s3_checkpoint.shards:
        expected.update(load_file(s3_checkpoint.path(shard)))
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype
        assert tensors[name].view(-1).view(torch.uint8).numpy().tobytes() == (
            tensor.view(-1).view(torch.uint8).numpy().tobytes()
        )


def test_cli_prefetch_reads_the_standard_aws_chain(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """Endpoint from AWS_ENDPOINT_URL, keys from the environment; only path-style addressing
    comes from ``[s3]`` (a bare IP has no per-bucket host names)."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    conf = tmp_path / "shardsync.toml"
    conf.write_text('[s3]\naddressing = "path"\nregion = "us-east-1"\n')
    env = {**os.environ, "AWS_ENDPOINT_URL": s3server.endpoint}
    cache = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch",
         f"s3://{s3bucket}/{PREFIX}/", "--cache-dir", str(cache), "--no-daemon", "--json",
         "--quiet"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert_snapshot_matches(Path(report["snapshot_path"]), s3_checkpoint)


def test_wrong_credentials_are_one_clear_error_without_secrets(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    secret = "wrong-" + s3server.secret_key[::-1]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    config = s3_config(tmp_path / "cache", s3server)
    with pytest.raises(AuthError) as caught:
        _run(prefetch(f"s3://{s3bucket}/{PREFIX}/", config))
    text = "".join(str(e) for e in _chain(caught.value))
    assert secret not in text and s3server.access_key not in text
    assert not any(p.is_file() for p in (config.cache_dir / "store").rglob("*"))


def test_no_credentials_at_all_is_an_auth_error(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unsigned requests to a bucket that is not public: refused, one clear error."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AuthError):
        _run(prefetch(f"s3://{s3bucket}/{PREFIX}/", s3_config(tmp_path / "c", s3server)))


async def test_a_public_bucket_is_read_unsigned_without_credentials(
    s3server: S3Server,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No credentials anywhere in the chain: requests go unsigned, as with
    ``aws --no-sign-request``, and a bucket anyone may read downloads, verified."""
    bucket, prefix = s3server.public_bucket(), f"anon/{tmp_path.name}"
    upload(s3server, bucket, s3_checkpoint, checksums=True, prefix=prefix)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    async with FaultGate(s3server.endpoint) as gate:
        config = s3_config(tmp_path / "cache", s3server, through=gate)
        result = await prefetch(f"s3://{bucket}/{prefix}/", config)
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)
    assert {f.verified for f in result.files} == {"sha256"}
    assert any(seen.method == "GET" and "list-type" not in seen.target for seen in gate.seen)
    for seen in gate.seen:
        assert "authorization" not in seen.headers and "Signature=" not in seen.target


@pytest.mark.parametrize(
    "url",
    [
        "s3://",
        "s3://a/x",
        "s3://bucket/../etc",
        "s3://bucket/a/./b",
        "s3://bu/x?y",
        "s3://b\x00k/",
        "s3://bucket/runs//llama/",  # S3 keeps the empty segment; runs/llama/ is another prefix
        "s3://bucket//llama/",
    ],
)
def test_hostile_s3_urls_are_refused_before_any_request(url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        _run(prefetch(url, fast_config(tmp_path / "c")))


class _Interrupted(Exception):
    """Stands in for a kill: the transfer stops, the partial and its record stay on disk."""


def _interrupt_after(limit: int) -> Throttle:
    seen = 0

    def throttle(n: int) -> float:
        nonlocal seen
        seen += n
        if seen > limit:
            raise _Interrupted
        return 0.0

    return throttle


async def _download_with(
    config: Config, source: str, throttle: Throttle | None = None
) -> tuple[Path, tuple[FileOutcome, ...]]:
    async with Engine(config, throttle=throttle) as engine:
        job = engine.job(engine.origin(source))
        await job.prepare()
        files = await job.download()
        return job.snapshot_path, files


def test_resume_after_an_interruption_reuses_the_partial(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    config = replace(s3_config(tmp_path / "cache", s3server), max_files=1)
    config = replace(config, fetch=replace(config.fetch, connections_per_file=1))
    source = f"s3://{s3bucket}/{PREFIX}/"
    size = s3_checkpoint.path(s3_checkpoint.shards[0]).stat().st_size
    with pytest.raises(_Interrupted):
        _run(_download_with(config, source, _interrupt_after(int(size * 0.6))))
    snapshot, files = _run(_download_with(config, source))
    assert_snapshot_matches(snapshot, s3_checkpoint)
    assert sum(f.resumed for f in files) > 0


def test_an_object_replaced_between_runs_is_never_mixed_with_its_partial(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """The resume record is bound to the ETag: a replaced object (same size, new bytes, no
    checksum to catch a mix) restarts from zero and the new bytes are published."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    config = replace(s3_config(tmp_path / "cache", s3server), max_files=1)
    config = replace(config, fetch=replace(config.fetch, connections_per_file=1))
    source = f"s3://{s3bucket}/{PREFIX}/"
    first = s3_checkpoint.shards[0]
    size = s3_checkpoint.path(first).stat().st_size
    with pytest.raises(_Interrupted):
        _run(_download_with(config, source, _interrupt_after(int(size * 0.6))))
    assert (config.cache_dir / "partial").is_dir()
    new = _same_size_other_bytes(s3_checkpoint.path(first).read_bytes())
    put(s3server, s3bucket, f"{PREFIX}/{first}", new)
    snapshot, _files = _run(_download_with(config, source))
    assert (snapshot / first).read_bytes() == new


@pytest.mark.parametrize("via", ["direct", "proxy"])
def test_an_object_replaced_mid_download_restarts_on_412(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    via: str,
) -> None:
    """``If-Match`` alone keeps the two objects apart: a gateway in front of the store takes
    the ETag off every 206 (as some CDNs do), so a 206 of the new object looks like one of
    the old, and only the 412 the store answers to the old ETag restarts the file. ``proxy``:
    the same through a forward proxy (the aiohttp body path)."""
    upload(s3server, s3bucket, s3_checkpoint, checksums=False)
    first = s3_checkpoint.shards[0]
    original = s3_checkpoint.path(first).read_bytes()
    new = _same_size_other_bytes(original)
    seen, replaced = 0, False

    def replace_at_40_percent(n: int) -> float:
        nonlocal seen, replaced
        seen += n
        if not replaced and seen > len(original) * 0.4:
            replaced = True
            put(s3server, s3bucket, f"{PREFIX}/{first}", new)
        return 0.0

    strip = without_fields("ETag", status=206)
    with contextlib.ExitStack() as stack:
        gateway = stack.enter_context(
            serve_in_thread(Relay(upstream=s3server.endpoint, edit_head=strip))
        )
        config = s3_config(tmp_path / "cache", replace(s3server, endpoint=gateway.url))
        config = replace(config, max_files=1)
        config = replace(config, fetch=replace(config.fetch, connections_per_file=1))
        if via == "proxy":
            proxy = stack.enter_context(serve_in_thread(Relay()))
            config = replace(config, network=network_from_env({"http_proxy": proxy.url}))
        snapshot, _files = _run(
            _download_with(config, f"s3://{s3bucket}/{PREFIX}/", replace_at_40_percent)
        )
        if via == "proxy":
            assert proxy.statuses("GET")
    assert replaced
    assert (snapshot / first).read_bytes() == new
    assert 412 in gateway.statuses("GET"), "no If-Match was refused: nothing tested it"


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


async def test_a_daemon_job_and_the_client_take_s3_sources(
    s3server: S3Server, s3bucket: str, s3_checkpoint: Checkpoint, aws_env: None, workdir: Path
) -> None:
    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    config = s3_config(workdir / "cache", s3server)
    async with daemon_in_loop(config, workdir / "d" / "d.sock") as running:
        client_config = replace(config, daemon=running.config.daemon)
        async with Client(client_config, fallback="error") as client:
            job = await client.prefetch(f"s3://{s3bucket}/{PREFIX}/")
            result = await job.wait()
    assert_snapshot_matches(result.snapshot_path, s3_checkpoint)


async def test_a_daemon_killed_mid_s3_job_resumes_it_after_a_restart(
    s3server: S3Server,
    s3bucket: str,
    s3_multipart_checkpoint: Checkpoint,
    aws_env: None,
    workdir: Path,
) -> None:
    """A real daemon, ``kill -9`` once 40% of boto3-default objects (a CRC32 per part) went
    out through a slow gateway: restarted, it resumes the journaled job from the partials,
    bound to each object's ETag, and checks each composite CRC over both runs' bytes."""
    checkpoint = s3_multipart_checkpoint
    upload_with(s3server, s3bucket, checkpoint, "CRC32", multipart=True)
    total = sum(checkpoint.path(rel).stat().st_size for rel in checkpoint.files)
    socket_path = workdir / "shardsync" / "d.sock"
    with serve_in_thread(Relay(upstream=s3server.endpoint, rate=1_000_000)) as gateway:
        s3_section = (
            f'[s3]\nendpoint = "{gateway.url}"\nregion = "{s3server.region}"\n'
            'addressing = "path"\nchunk_size = "1MiB"\n'
        )
        conf = write_config(
            workdir / "d.toml",
            cache=workdir / "cache",
            endpoint="http://127.0.0.1:9",  # no Hub: nothing may ask it
            socket_path=socket_path,
            daemon=s3_section,
        )
        process = DaemonProcess(conf, workdir)
        try:
            await asyncio.to_thread(process.start)
            async with Client(socket=socket_path, fallback="error") as client:
                job = await client.prefetch(f"s3://{s3bucket}/{PREFIX}/")
                async with asyncio.timeout(60):
                    await until(lambda: gateway.body_bytes >= 0.4 * total)
                process.signal(signal.SIGKILL)
                with pytest.raises(DaemonError):
                    await job.wait()
            assert await asyncio.to_thread(process.wait) == -signal.SIGKILL
            gateway.rate = 0
            await asyncio.to_thread(process.start)
            async with Client(socket=socket_path, fallback="error") as client:
                result = await (await client.job(job.id)).wait()  # the journal kept it
            process.signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait) == 0
        finally:
            process.close()
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    shards = [f for f in result.files if f.path in checkpoint.shards]
    assert {f.verified for f in shards} == {"crc32"}
    assert sum(f.resumed for f in shards) > 0
    refetched = gateway.body_bytes - total  # the listing, the parts' HEADs and what was lost
    assert refetched < 0.10 * total, f"re-fetched {refetched} of {total} bytes"


async def test_a_shard_replaced_between_the_daemons_plan_and_its_download_is_never_placed(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a daemon, the headers a load plans from (``POST /v1/prepare``) and the shards
    (the job after it) are two looks at the store, and an S3 object has no commit to pin. A
    shard replaced in between by one whose header is longer (the same tensors, their bytes
    moved) is never placed at the offsets planned from the old header: the load fails."""
    import shardsync
    from shardsync.errors import LoadError
    from shardsync.prefetch import Engine

    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    shard = s3_checkpoint.shards[0]
    data = s3_checkpoint.path(shard).read_bytes()
    n = int.from_bytes(data[:8], "little")
    longer = data[8 : 8 + n] + b" " * 64  # JSON may end in spaces: the same header, longer
    moved = len(longer).to_bytes(8, "little") + longer + data[8 + n :]
    original = Engine.prepare

    async def prepare_then_replace(self: Engine, *args: Any, **kwargs: Any) -> Any:
        prepared = await original(self, *args, **kwargs)
        await asyncio.to_thread(put, s3server, s3bucket, f"{PREFIX}/{shard}", moved, True)
        return prepared

    monkeypatch.setattr(Engine, "prepare", prepare_then_replace)
    config = s3_config(workdir / "cache", s3server)
    async with daemon_in_loop(config, workdir / "d" / "d.sock") as running:
        mine = replace(s3_config(workdir / "mine", s3server), daemon=running.config.daemon)
        with pytest.raises(LoadError):
            await asyncio.to_thread(
                shardsync.load, f"s3://{s3bucket}/{PREFIX}/", config=mine, device_map="cpu"
            )


async def test_a_prefix_resharded_between_the_daemons_plan_and_its_download_fails_the_load(
    s3server: S3Server,
    s3bucket: str,
    s3_checkpoint: Checkpoint,
    aws_env: None,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefix is saved again in two shards of other names after the load planned from
    three: the daemon's job never verifies the planned shards. The load fails; it does not
    wait for them for ever."""
    import shardsync
    from shardsync.errors import LoadError
    from shardsync.prefetch import Engine

    upload(s3server, s3bucket, s3_checkpoint, checksums=True)
    resharded = build_checkpoint(workdir / "two", total_bytes=2 << 20, n_shards=2, seed=7)
    original = Engine.prepare

    async def prepare_then_reshard(self: Engine, *args: Any, **kwargs: Any) -> Any:
        prepared = await original(self, *args, **kwargs)
        for rel in s3_checkpoint.files:
            await asyncio.to_thread(
                s3(s3server).delete_object, Bucket=s3bucket, Key=f"{PREFIX}/{rel}"
            )
        await asyncio.to_thread(upload, s3server, s3bucket, resharded, checksums=True)
        return prepared

    monkeypatch.setattr(Engine, "prepare", prepare_then_reshard)
    config = s3_config(workdir / "cache", s3server)
    async with daemon_in_loop(config, workdir / "d" / "d.sock") as running:
        mine = replace(s3_config(workdir / "mine", s3server), daemon=running.config.daemon)
        failed: list[BaseException] = []

        def load() -> None:
            try:
                shardsync.load(f"s3://{s3bucket}/{PREFIX}/", config=mine, device_map="cpu")
            except BaseException as exc:
                failed.append(exc)

        loading = threading.Thread(target=load, daemon=True)  # one that hangs ends with us
        loading.start()
        await asyncio.to_thread(loading.join, 60)
        assert not loading.is_alive(), "the load waits for shards the job never verifies"
        assert [type(e) for e in failed] == [LoadError]


def _same_size_other_bytes(data: bytes) -> bytes:
    """The same header (the same shard, as far as its shape tells), other tensor bytes."""
    start = 8 + int.from_bytes(data[:8], "little")
    return data[:start] + bytes((b + 1) & 0xFF for b in data[start:])


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _run(coro: Coroutine[Any, Any, _T]) -> _T:
    return asyncio.run(coro)
