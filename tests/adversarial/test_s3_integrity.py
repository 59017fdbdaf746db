"""Transfer integrity on the ``s3://`` origin, on every body path, judged by the store's bytes.

The same lies as ``test_transfer_integrity.py`` tells for the Hub and plain URLs, here told by
a gateway (``shardsync.testing.relay.Relay``) between shardsync and a real store (SeaweedFS):
it moves the ``Range`` of a request, so the store answers a truthful 206 of other bytes, or
drops it, so the store answers 200 with the whole object. The objects keep no checksum
(``verified=tofu``), so only the transfer's own checks (where a 206 starts, a 200 to a Range
request) stand between such a gateway and a corrupt snapshot; a store's CRC would catch the
wrong bytes at the end and hide a missing check behind a retry.

Body paths: ``direct`` (the gateway is the store's endpoint: the pump), ``chunked`` (the
gateway sends every body chunked: aiohttp's path) and ``proxy`` (a forward proxy in front of
the gateway: aiohttp's path).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from helpers import assert_snapshot_matches, assert_store_verified, fast_config, s3

from shardsync.config import Config, S3Config
from shardsync.network import network_from_env
from shardsync.prefetch import prefetch
from shardsync.records import PrefetchResult
from shardsync.testing import Checkpoint, build_checkpoint, serve_in_thread
from shardsync.testing.relay import Fields, Relay
from shardsync.testing.seaweedfs import S3Server

PREFIX = "integrity"
PATHS = ("direct", "chunked", "proxy")
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Two shards of ~1.5 MiB: six 256 KiB ranges each with `fast_config`."""
    return build_checkpoint(
        tmp_path_factory.mktemp("s3integrity"), total_bytes=3 << 20, n_shards=2, seed=15
    )


@dataclass
class MoveRange:
    """A ``RequestEdit`` for the first ``times`` Range requests of shards: the range moved by
    ``shift`` (clipped at byte 0), or with ``shift=None`` dropped.

    ``asked_again``: as the fake Hub's faults take it, only a shard and ``Range`` asked for
    before. The client's pump asks an object's first ranges, finds their answers chunked and
    hands them to aiohttp unread, which asks them again: a lie told to the pump tests
    nothing. ``handed_over`` counts the ranges asked twice."""

    shift: int | None
    times: int
    asked_again: bool = False
    moved: list[str] = field(default_factory=list)  # the ranges it changed, as asked
    handed_over: int = 0
    _asked: set[tuple[str, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, method: str, target: str, fields: Fields) -> Fields:
        key = target.partition("?")[0]
        if method != "GET" or not key.endswith(".safetensors"):
            return fields
        asked = next((v for n, v in fields if n.lower() == "range"), None)
        found = _RANGE.fullmatch(asked or "")
        if asked is None or found is None:
            return fields
        start, end = int(found[1]), int(found[2])
        with self._lock:
            before = (key, asked) in self._asked
            self._asked.add((key, asked))
            self.handed_over += before
            if self.asked_again and not before:
                return fields
            if len(self.moved) >= self.times:
                return fields
            if self.shift is not None and max(0, start + self.shift) == start:
                return fields  # clipped to the asked range: no lie to tell
            self.moved.append(asked)
        others = [(n, v) for n, v in fields if n.lower() != "range"]
        if self.shift is None:
            return others
        return [*others, ("Range", f"bytes={max(0, start + self.shift)}-{end + self.shift}")]


@contextlib.contextmanager
def through_gateway(
    config: Config, server: S3Server, lie: MoveRange, path: str
) -> Iterator[Config]:
    """``config`` reading ``server`` through a lying gateway, on the body ``path``; checks
    afterwards that the bodies took that path."""
    with contextlib.ExitStack() as stack:
        gateway = stack.enter_context(
            serve_in_thread(
                Relay(upstream=server.endpoint, edit_request=lie, chunked=path == "chunked")
            )
        )
        s3config = S3Config(gateway.url, server.region, "path", chunk_size=config.fetch.chunk_size)
        config = replace(config, s3=s3config)
        proxy = None
        if path == "proxy":
            proxy = stack.enter_context(serve_in_thread(Relay()))
            config = replace(config, network=network_from_env({"http_proxy": proxy.url}))
        yield config
        if proxy is not None:
            assert proxy.statuses("GET"), "nothing went through the proxy"
        if path == "chunked":
            assert lie.handed_over, "the pump handed no chunked answer to aiohttp"


def upload_plain(server: S3Server, bucket: str, checkpoint: Checkpoint) -> None:
    """Every file as a plain PutObject: the store keeps no checksum of it."""
    for rel in checkpoint.files:
        body = checkpoint.path(rel).read_bytes()
        s3(server).put_object(Bucket=bucket, Key=f"{PREFIX}/{rel}", Body=body)


async def fetch_through(
    server: S3Server, bucket: str, checkpoint: Checkpoint, cache: Path, lie: MoveRange, path: str
) -> PrefetchResult:
    """Upload ``checkpoint``, prefetch it through the lying gateway on ``path``, and check
    that every lie was told and that the snapshot and the store hold the origin's bytes."""
    upload_plain(server, bucket, checkpoint)
    with through_gateway(fast_config(cache), server, lie, path) as config:
        result = await prefetch(f"s3://{bucket}/{PREFIX}/", config)
    assert len(lie.moved) == lie.times
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(cache, checkpoint)
    return result


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shift", [-4096, 4096, -(300 << 10)], ids=["early", "late", "far-early"])
async def test_a_206_of_other_bytes_from_a_store_is_never_written_at_the_asked_offset(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    checkpoint: Checkpoint,
    tmp_path: Path,
    path: str,
    shift: int,
) -> None:
    lie = MoveRange(shift, times=4, asked_again=path == "chunked")
    result = await fetch_through(s3server, s3bucket, checkpoint, tmp_path, lie, path)
    assert {f.verified for f in result.files} == {"tofu"}


@pytest.mark.parametrize("path", PATHS)
async def test_a_whole_object_from_a_store_to_a_range_request_is_never_written_at_its_offset(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    checkpoint: Checkpoint,
    tmp_path: Path,
    path: str,
) -> None:
    """A gateway that drops ``Range``: the store answers 200 with the whole object, whose
    first byte is byte 0, whatever range was asked for."""
    lie = MoveRange(None, times=3, asked_again=path == "chunked")
    await fetch_through(s3server, s3bucket, checkpoint, tmp_path, lie, path)
