"""The SeaweedFS fixture itself: it serves S3, checks signatures, and honours Range."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiobotocore.session import get_session
from botocore.exceptions import ClientError

from shardsync.testing.seaweedfs import S3Server, S3ServerUnavailable, find_weed, run_seaweedfs


@pytest.fixture
async def s3(s3server: S3Server) -> AsyncIterator[Any]:
    async with get_session().create_client("s3", **s3server.client_kwargs()) as client:
        yield client


async def test_put_get_list(s3: Any, s3bucket: str) -> None:
    await s3.put_object(Bucket=s3bucket, Key="a/one.bin", Body=b"1" * 100)
    await s3.put_object(Bucket=s3bucket, Key="a/two.bin", Body=b"22")
    await s3.put_object(Bucket=s3bucket, Key="b.txt", Body=b"b")
    got = await s3.get_object(Bucket=s3bucket, Key="a/two.bin")
    async with got["Body"] as body:
        assert await body.read() == b"22"
    listed = await s3.list_objects_v2(Bucket=s3bucket, Prefix="a/")
    assert [(o["Key"], o["Size"]) for o in listed["Contents"]] == [
        ("a/one.bin", 100),
        ("a/two.bin", 2),
    ]


async def test_ranged_get(s3: Any, s3bucket: str) -> None:
    data = bytes(range(256)) * 40
    await s3.put_object(Bucket=s3bucket, Key="blob", Body=data)
    got = await s3.get_object(Bucket=s3bucket, Key="blob", Range="bytes=100-1099")
    async with got["Body"] as body:
        assert await body.read() == data[100:1100]
    assert got["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert got["ContentRange"] == f"bytes 100-1099/{len(data)}"


async def test_buckets_are_fresh_and_distinct(s3: Any, s3server: S3Server, s3bucket: str) -> None:
    other = s3server.new_bucket("other")
    assert other != s3bucket
    for name in (s3bucket, other):
        assert (await s3.list_objects_v2(Bucket=name)).get("KeyCount") == 0


async def test_signatures_are_checked(s3server: S3Server, s3bucket: str) -> None:
    wrong = replace(s3server, secret_key="not-the-secret")
    async with get_session().create_client("s3", **wrong.client_kwargs()) as bad:
        with pytest.raises(ClientError) as info:
            await bad.list_objects_v2(Bucket=s3bucket)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert info.value.response["Error"]["Code"] == "SignatureDoesNotMatch"


def test_missing_binary_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEAWEEDFS_WEED", str(tmp_path / "no-such-weed"))
    assert find_weed() is None
    with pytest.raises(S3ServerUnavailable, match="not installed"), run_seaweedfs(tmp_path):
        pass


def test_the_server_runs_in_its_own_process_group(s3server: S3Server) -> None:
    # Teardown kills that whole group; it must not be the test runner's.
    assert os.getpgid(s3server.pid) == s3server.pid != os.getpgid(0)


def test_teardown_leaves_no_process(tmp_path: Path) -> None:
    try:
        with run_seaweedfs(tmp_path / "own") as server:
            pid = server.pid
            assert server.new_bucket()
    except S3ServerUnavailable as exc:
        pytest.skip(str(exc))
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
