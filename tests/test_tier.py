"""The fleet's shared S3 tier against a real SeaweedFS: N hosts are N cache roots (and, where
it matters, N processes) pulling one checkpoint from one fake Hub.

Every check compares with what the Hub served or holds, never with the cache's own names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from bodypaths import BodyPath
from daemons import api, cli, daemon_in_loop, short_tmp
from faultgate import FaultGate, GateFault
from helpers import (
    Bars,
    assert_snapshot_matches,
    assert_store_verified,
    fast_config,
    s3,
    s3_keys,
    serving,
    tmpfs,
    until,
)

from shardsync.client import Client
from shardsync.config import Config, S3Config, TierConfig
from shardsync.daemon import Daemon
from shardsync.prefetch import Engine, prefetch
from shardsync.records import FetchConfig, PrefetchResult, TierStatistics
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint
from shardsync.testing.seaweedfs import S3Server
from shardsync.tier_claims import Watch, blob_key, claim_key

REPO = "acme/fleet"
PREFIX = "fleet/"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Four shards of ~1 MiB: several Range requests each with `fast_config`."""
    return build_checkpoint(tmp_path_factory.mktemp("fleet"), total_bytes=4 << 20, n_shards=4)


@pytest.fixture
async def hub(model: Checkpoint) -> AsyncIterator[FakeHub]:
    async with FakeHub() as fake:
        fake.add_checkpoint(REPO, model)
        yield fake


def host(cache_dir: Path, hub: FakeHub, server: S3Server, bucket: str, **tier: Any) -> Config:
    """One host of the fleet: its own cache, the shared Hub and tier."""
    s3 = S3Config(endpoint=server.endpoint, region=server.region, addressing="path")
    return replace(
        fast_config(cache_dir, hub.endpoint),
        s3=s3,
        tier=TierConfig(url=f"s3://{bucket}/{PREFIX}", **tier),
    )


def shard_bytes(model: Checkpoint) -> int:
    return sum(model.path(s).stat().st_size for s in model.shards)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tier_objects(server: S3Server, bucket: str) -> dict[str, bytes]:
    client = s3(server)
    return {
        key: client.get_object(Bucket=bucket, Key=key)["Body"].read()
        for key in s3_keys(server, bucket, PREFIX)
    }


def expected_tier(model: Checkpoint) -> dict[str, bytes]:
    """The contract: every shard (LFS file) under PREFIX/sha256/<aa>/<sha256>, nothing else."""
    out: dict[str, bytes] = {}
    for shard in model.shards:
        data = model.path(shard).read_bytes()
        out[blob_key(PREFIX, sha(data))] = data
    return out


def seed_tier(server: S3Server, bucket: str, model: Checkpoint, shards: int | None = None) -> None:
    for shard in model.shards[:shards]:
        data = model.path(shard).read_bytes()
        s3(server).put_object(Bucket=bucket, Key=blob_key(PREFIX, sha(data)), Body=data)


def sources(result: PrefetchResult, model: Checkpoint) -> list[str]:
    by_path = {f.path: f.source for f in result.files}
    return [by_path[s] for s in model.shards]


# ---------------------------------------------------------------------------------- fleets


async def test_hosts_at_once_cost_the_hub_one_copy_and_fill_the_tier_per_the_contract(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    hub.faults.add(Bandwidth(2_000_000))  # slow enough that the hosts overlap
    configs = [host(tmp_path / f"host{i}", hub, s3server, s3bucket) for i in range(4)]
    results = await asyncio.gather(*(prefetch(REPO, c) for c in configs))
    served = hub.bytes_served("*.safetensors")
    assert served <= 1.05 * shard_bytes(model), served / shard_bytes(model)
    for config, result in zip(configs, results, strict=True):
        assert_snapshot_matches(result.snapshot_path, model)
        assert_store_verified(config.cache_dir, model)
    assert sum(r.tier.claims_won for r in results if r.tier) == len(model.shards)
    objects = tier_objects(s3server, s3bucket)
    assert objects == expected_tier(model)  # the key layout, and no claim left behind

    hub.reset_log()
    fifth = await prefetch(REPO, host(tmp_path / "host5", hub, s3server, s3bucket))
    assert hub.bytes_served("*.safetensors") == 0
    assert sources(fifth, model) == ["tier"] * len(model.shards)
    assert_snapshot_matches(fifth.snapshot_path, model)
    assert fifth.bytes_from_tier == shard_bytes(model)


async def _fill_then_read(
    gate: FaultGate,
    server: S3Server,
    bucket: str,
    hub: FakeHub,
    model: Checkpoint,
    tmp_path: Path,
    **s3: Any,
) -> None:
    """One host fills the tier through ``gate`` (``s3``: its [s3] settings), a second reads
    every shard from it, and both snapshots are the model's."""
    via = S3Server(**{**server.__dict__, "endpoint": gate.endpoint})
    configs = [host(tmp_path / f"h{i}", hub, via, bucket) for i in (1, 2)]
    first, second = (replace(c, s3=replace(c.s3, **s3)) for c in configs)
    filled = await prefetch(REPO, first)
    hub.reset_log()
    read = await prefetch(REPO, second)
    for result in (filled, read):
        assert_snapshot_matches(result.snapshot_path, model)
    assert filled.tier is not None and filled.tier.uploads == len(model.shards)
    assert sources(read, model) == ["tier"] * len(model.shards)
    assert hub.bytes_served("*.safetensors") == 0


async def test_a_tier_bucket_in_another_region_is_filled_and_read(
    s3server: S3Server, s3bucket: str, model: Checkpoint, hub: FakeHub, aws_reads: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The tier's bucket lives in another region than the hosts' client: its claims and
    uploads follow the store's "wrong region" answers, and its presigned GETs must be
    signed for the bucket's region too (S3 refuses any other with 400)."""
    home = "eu-west-1"
    assert s3server.region != home
    async with FaultGate(s3server.endpoint, home_region=home) as gate:
        await _fill_then_read(gate, s3server, s3bucket, hub, model, tmp_path)
    gets = [seen for seen in gate.seen if seen.presigned]
    assert gets and all(seen.status in (200, 206) for seen in gets)


async def test_a_requester_pays_tier_bucket_is_filled_and_read(
    s3server: S3Server, s3bucket: str, model: Checkpoint, hub: FakeHub, aws_reads: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """With ``[s3] requester_pays`` the tier's claims, uploads, HEADs and presigned GETs
    all say the reader pays, so a Requester Pays bucket serves as the fleet's tier."""
    async with FaultGate(s3server.endpoint, requester_pays=True) as gate:
        await _fill_then_read(gate, s3server, s3bucket, hub, model, tmp_path, requester_pays=True)
    assert [seen for seen in gate.seen if seen.presigned]
    assert all(seen.status != 403 for seen in gate.seen)  # none refused for not paying


async def test_hosts_that_start_together_each_win_a_claim(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A host that holds a claim lets the others claim first (``claim_courtesy``): hosts
    arriving while it downloads win the other blobs, so a host that dies holds one blob's
    progress, not the whole model's."""
    hub.faults.add(Bandwidth(2_000_000))
    configs = [
        host(tmp_path / f"host{i}", hub, s3server, s3bucket, claim_courtesy=3.0) for i in range(4)
    ]
    first = asyncio.create_task(prefetch(REPO, configs[0]))
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(s3_keys, s3server, s3bucket, f"{PREFIX}claims/"):
        assert time.monotonic() < deadline and not first.done(), "the first host never claimed"
        await asyncio.sleep(0.02)
    others = await asyncio.gather(*(prefetch(REPO, c) for c in configs[1:]))
    results = [await first, *others]
    assert [r.tier.claims_won if r.tier else None for r in results] == [1, 1, 1, 1]
    served = hub.bytes_served("*.safetensors")
    assert served <= 1.05 * shard_bytes(model), served / shard_bytes(model)
    for result in results:
        assert_snapshot_matches(result.snapshot_path, model)
    assert tier_objects(s3server, s3bucket) == expected_tier(model)


def test_four_processes_at_once_cost_the_hub_about_one_copy(
    s3server: S3Server, s3bucket: str, model: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """The same with real `shardsync prefetch` processes, as on four machines."""
    conf = tmp_path / "shardsync.toml"
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\naddressing = "path"\nregion = "us-east-1"\n'
        f'[tier]\nurl = "s3://{s3bucket}/{PREFIX}"\n'
    )
    with serving({REPO: model}) as fake:
        fake.faults.add(Bandwidth(1_000_000))
        env = {**os.environ, "HF_ENDPOINT": fake.endpoint}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shardsync.cli",
                    "--config",
                    str(conf),
                    "prefetch",
                    REPO,
                    "--cache-dir",
                    str(tmp_path / f"h{i}"),
                    "--no-daemon",
                    "--json",
                    "--quiet",
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(4)
        ]
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err
            reports.append(json.loads(out))
        served = fake.bytes_served("*.safetensors")
    assert served <= 1.15 * shard_bytes(model), served / shard_bytes(model)
    for report in reports:
        assert_snapshot_matches(Path(report["snapshot_path"]), model)
    assert tier_objects(s3server, s3bucket) == expected_tier(model)


# ---------------------------------------------------------------------------------- faults


@pytest.mark.parametrize("how", ["flipped byte", "wrong size", "other object"])
async def test_a_corrupt_tier_object_is_caught_replaced_and_never_published(
    how: str,
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    body_path: BodyPath,
) -> None:
    """On each body path (``chunked``: the Hub's answers; the store always sends a length)."""
    body_path.arm(hub)
    seed_tier(s3server, s3bucket, model)
    victim = model.path(model.shards[1]).read_bytes()
    bad = {
        "flipped byte": victim[:1000] + bytes([victim[1000] ^ 1]) + victim[1001:],
        "wrong size": victim[:-7],
        "other object": model.path(model.shards[2])
        .read_bytes()[: len(victim)]
        .ljust(len(victim), b"\0"),
    }[how]
    s3(s3server).put_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha(victim)), Body=bad)
    config = body_path.configure(host(tmp_path / "h", hub, s3server, s3bucket))
    result = await prefetch(REPO, config)
    body_path.check()
    assert_snapshot_matches(result.snapshot_path, model)
    assert_store_verified(config.cache_dir, model)  # the corrupt bytes were never published
    assert result.tier is not None and result.tier.corrupt_objects == 1
    assert sources(result, model) == ["tier", "network", "tier", "tier"]
    assert tier_objects(s3server, s3bucket) == expected_tier(model)  # repaired


async def test_a_tier_that_is_down_costs_one_warning_and_the_job_goes_on(
    model: Checkpoint, hub: FakeHub, s3server: S3Server, aws_env: None, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    closed = S3Server(**{**s3server.__dict__, "endpoint": "http://127.0.0.1:9"})
    config = host(tmp_path / "h", hub, closed, "nobucket")
    with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
        result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.errors >= 1
    assert sources(result, model) == ["network"] * len(model.shards)
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1


async def test_a_dead_tier_is_asked_at_most_twice_per_request(
    model: Checkpoint, hub: FakeHub, s3server: S3Server, aws_env: None, tmp_path: Path
) -> None:
    """A tier that resets every connection: each request is tried once more (0.1 s later,
    not after botocore's backoff of up to a second, which cost a 95 MB job 2 s), then the
    tier is down and asked nothing else. (aiohttp itself sends an idempotent request again
    once when the connection drops: two connections per try.)"""
    tries = 0

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal tries
        tries += 1
        await reader.read(1)
        writer.transport.abort()

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    listener = await asyncio.start_server(reset, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        dead = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{port}"})
        result = await prefetch(REPO, host(tmp_path / "h", hub, dead, "nobucket"), sleep=sleep)
    finally:
        listener.close()
    assert_snapshot_matches(result.snapshot_path, model)
    assert sources(result, model) == ["network"] * len(model.shards)
    assert 1 <= tries <= 2 * 2 * len(model.shards)  # the files' first looks, and no more
    assert set(waits) <= {0.1}  # each retry 0.1 s after its try, none after a backoff


async def test_a_tier_refusing_every_put_with_503_costs_one_warning(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store that is up but refuses every write (full, throttling): the claim fails, the
    tier is skipped, the job comes from the origin once, and the log has one warning."""
    async with FaultGate(s3server.endpoint, refuse_puts=503) as gate:
        via = S3Server(**{**s3server.__dict__, "endpoint": gate.endpoint})
        with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
            result = await prefetch(REPO, host(tmp_path / "h", hub, via, s3bucket))
    assert_snapshot_matches(result.snapshot_path, model)
    assert sources(result, model) == ["network"] * len(model.shards)
    assert hub.bytes_served("*.safetensors") == shard_bytes(model)
    assert result.tier is not None and result.tier.errors >= 1 and result.tier.uploads == 0
    assert 1 <= sum(1 for s in gate.seen if s.method == "PUT") <= 2  # one claim, tried twice
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1
    assert tier_objects(s3server, s3bucket) == {}


async def test_a_tier_that_hangs_costs_seconds_and_one_warning(
    model: Checkpoint, hub: FakeHub, s3server: S3Server, aws_env: None, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A tier that accepts connections and never answers (a hung gateway): the job goes on
    from the origin after one request's patience, not after botocore's read timeouts."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read nothing, answer nothing, close nothing

    listener = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        hung = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{port}"})
        config = host(tmp_path / "h", hub, hung, "nobucket")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
            result = await prefetch(REPO, config)
        took = time.monotonic() - started
    finally:
        for writer in held:
            writer.transport.abort()
        listener.close()
    assert held, "nothing reached the hung tier: the case proves nothing"
    assert_snapshot_matches(result.snapshot_path, model)
    assert sources(result, model) == ["network"] * len(model.shards)
    assert result.tier is not None and result.tier.errors >= 1
    assert took < 15, f"a hung tier held the job up {took:.1f} s"
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1


async def test_wrong_tier_credentials_turn_the_tier_off_with_one_warning(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seed_tier(s3server, s3bucket, model)
    secret = "not-" + s3server.secret_key
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
        result = await prefetch(REPO, host(tmp_path / "h", hub, s3server, s3bucket))
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.disabled
    assert sources(result, model) == ["network"] * len(model.shards)
    warnings = [r.getMessage() for r in caplog.records if r.name == "shardsync.tier"]
    assert len(warnings) == 1
    assert secret not in warnings[0] and s3server.access_key not in warnings[0]


async def test_a_tier_refusing_writes_is_still_read(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    seed_tier(s3server, s3bucket, model, shards=2)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3server.readonly_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3server.readonly_secret_key)
    with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
        result = await prefetch(REPO, host(tmp_path / "h", hub, s3server, s3bucket))
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.read_only and not result.tier.disabled
    assert sources(result, model) == ["tier", "tier", "network", "network"]
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1
    assert len(tier_objects(s3server, s3bucket)) == 2  # nothing written


async def test_a_read_only_identity_meeting_a_corrupt_object_still_reads_the_rest(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deleting a corrupt object is a write, which a read-only identity may not do: its
    refusal turned the whole tier off, and every good object after it came from the Hub."""
    seed_tier(s3server, s3bucket, model)
    victim = model.path(model.shards[0]).read_bytes()
    flipped = victim[:1000] + bytes([victim[1000] ^ 1]) + victim[1001:]
    s3(s3server).put_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha(victim)), Body=flipped)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3server.readonly_access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3server.readonly_secret_key)
    config = host(tmp_path / "h", hub, s3server, s3bucket)
    result = await prefetch(REPO, replace(config, max_files=1))  # the corrupt one first
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and not result.tier.disabled and result.tier.read_only
    assert sources(result, model) == ["network", "tier", "tier", "tier"]


@pytest.mark.parametrize("size", [1 << 20, 6 << 20], ids=["one-put", "multipart"])
async def test_a_blob_gone_before_its_upload_is_a_local_error_not_a_dead_tier(
    s3server: S3Server, s3bucket: str, aws_env: None, tmp_path: Path, size: int, monkeypatch: Any
) -> None:
    """A blob pruned (or unreadable) before its upload: ours to report, not the store's.
    It was a ``TransferError`` (the tier taken for down for a minute) in one PUT, and a bare
    ``FileNotFoundError`` in a multipart upload, which ended the tier's task group and the
    engine's task with it."""
    from shardsync import s3 as s3_module
    from shardsync.errors import CacheError
    from shardsync.s3 import S3Client

    monkeypatch.setattr(s3_module, "MAX_SINGLE_PUT", 4 << 20)  # S3's 5 GiB, in small
    client = S3Client(
        S3Config(endpoint=s3server.endpoint, region=s3server.region, addressing="path")
    )
    try:
        with pytest.raises(CacheError):
            await client.put_file(s3bucket, "gone", tmp_path / "gone", sha256="0" * 64, size=size)
    finally:
        await client.aclose()
    assert "gone" not in s3_keys(s3server, s3bucket, "")


class _Cut:
    """A TCP proxy in front of the store that can drop every connection at once."""

    def __init__(self, upstream: tuple[str, int], *, pace_up: float = 0.0) -> None:
        self.upstream = upstream
        self.pace_up = pace_up  # seconds per 16 KiB sent to the store (a slow uplink)
        self.port = 0
        self.down = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> _Cut:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()

    def cut(self) -> None:
        self.down = True
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, pace: float) -> None:
            with contextlib.suppress(OSError, ConnectionError):
                while data := await src.read(16384):
                    dst.write(data)
                    await dst.drain()
                    await asyncio.sleep(pace)  # no megabytes in flight: a cut loses bytes
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, self.pace_up), pipe(up_reader, writer, 0.005))


async def test_a_tier_cut_mid_read_falls_back_to_the_origin(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    seed_tier(s3server, s3bucket, model)
    port = int(s3server.endpoint.rsplit(":", 1)[1])
    async with _Cut(("127.0.0.1", port)) as proxy:
        via = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{proxy.port}"})
        config = host(tmp_path / "h", hub, via, s3bucket)
        config = replace(config, max_files=1)
        first = model.path(model.shards[0]).stat().st_size
        seen = 0

        def cut_at_40_percent(n: int) -> float:
            nonlocal seen
            seen += n
            if seen > 0.4 * first and not proxy.down:
                proxy.cut()
            return 0.0

        bars = Bars()
        async with Engine(config, throttle=cut_at_40_percent) as engine:
            job = engine.job(engine.origin(REPO), sink=bars)
            await job.prepare()
            files = await job.download()
            snapshot, tier = job.snapshot_path, engine.tier
            assert tier is not None
            stats = tier.statistics()
    assert_snapshot_matches(snapshot, model)
    assert_store_verified(config.cache_dir, model)
    assert proxy.down and stats.errors >= 1
    assert [f.source for f in files if f.path in model.shards] == ["network"] * 4
    for path, size in bars.sizes.items():  # the tier's bytes were taken back off the bar
        assert bars.now[path] == size and bars.peak[path] <= (size or 0), path


async def test_a_tier_stalling_mid_read_costs_seconds_not_the_origins_retries(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """The tier answers each GET's head and then nothing (a wedged volume server): with the
    shipped read timeout (30 s) and retries (8), a tier read waited minutes before the
    origin was asked. It is given up within 5 s and its size at ``upload_floor``."""
    seed_tier(s3server, s3bucket, model)
    async with FaultGate(s3server.endpoint, fault=GateFault("stall", stall_s=600)) as gate:
        via = S3Server(**{**s3server.__dict__, "endpoint": gate.endpoint})
        config = host(tmp_path / "h", hub, via, s3bucket)
        shipped = FetchConfig()
        fetch = replace(config.fetch, read_timeout=shipped.read_timeout, retry=shipped.retry)
        started = time.monotonic()
        async with asyncio.timeout(60):
            result = await prefetch(REPO, replace(config, fetch=fetch))
        took = time.monotonic() - started
    assert_snapshot_matches(result.snapshot_path, model)
    assert sources(result, model) == ["network"] * len(model.shards)
    assert took < 20, took  # 5.1 s of deadline, the origin's download, a busy machine


async def test_a_tier_dying_mid_job_costs_one_warning_and_no_wait_at_the_end(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tier dies 40% into the first shard, while this host holds its claims: the job ends
    from the origin, the blobs it owed the fleet are given up within a second of the snapshot
    being complete (not after every upload's retries), and the log has one warning."""
    port = int(s3server.endpoint.rsplit(":", 1)[1])
    async with _Cut(("127.0.0.1", port)) as proxy:
        via = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{proxy.port}"})
        config = replace(host(tmp_path / "h", hub, via, s3bucket), max_files=1)
        first = model.path(model.shards[0]).stat().st_size
        seen = 0

        def cut_at_40_percent(n: int) -> float:
            nonlocal seen
            seen += n
            if seen > 0.4 * first and not proxy.down:
                proxy.cut()
            return 0.0

        with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
            async with Engine(config, throttle=cut_at_40_percent) as engine:
                job = engine.job(engine.origin(REPO))
                await job.prepare()
                files = await job.download()
                complete = time.monotonic()
                snapshot, tier = job.snapshot_path, engine.tier
            left = time.monotonic() - complete
    assert tier is not None and proxy.down
    assert_snapshot_matches(snapshot, model)
    assert [f.source for f in files if f.path in model.shards] == ["network"] * 4
    assert tier.statistics().errors >= 1 and tier.statistics().uploads == 0
    assert left < 1.5, f"the engine took {left:.1f} s to leave a dead tier"
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1


@pytest.mark.parametrize("lease", [1.0, None])
def test_a_claim_holder_killed_mid_download_is_taken_over(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    lease: float | None,
) -> None:
    """``None``: the default lease, which must cost the taker seconds, not half a minute."""
    conf = tmp_path / "shardsync.toml"
    leased = "" if lease is None else f'claim_lease = "{lease}s"\n'
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\naddressing = "path"\nregion = "us-east-1"\n'
        f'[tier]\nurl = "s3://{s3bucket}/{PREFIX}"\n{leased}claim_stall = "30s"\n'
    )
    first = model.path(model.shards[0]).read_bytes()
    with serving({REPO: model}) as fake:
        fake.faults.add(Bandwidth(100_000))  # ~3 s per shard on 4 connections
        env = {**os.environ, "HF_ENDPOINT": fake.endpoint}
        holder = subprocess.Popen(
            [sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch", REPO,
             "--cache-dir", str(tmp_path / "holder"), "--no-daemon", "--quiet"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for_progress(s3server, s3bucket, claim_key(PREFIX, sha(first)), holder)
        finally:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        fake.faults.clear()
        tier = TierConfig(url=f"s3://{s3bucket}/{PREFIX}")
        tier = tier if lease is None else replace(tier, claim_lease=lease)
        config = replace(fast_config(tmp_path / "taker", fake.endpoint), s3=S3Config(
            endpoint=s3server.endpoint, region=s3server.region, addressing="path"
        ), tier=tier)  # fmt: skip
        started = time.monotonic()
        result = asyncio.run(prefetch(REPO, config))
        waited = time.monotonic() - started
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.claims_taken_over >= 1
    assert waited < 20
    assert tier_objects(s3server, s3bucket) == expected_tier(model)


def _wait_for_progress(
    server: S3Server, bucket: str, key: str, proc: subprocess.Popen[bytes]
) -> None:
    """Until the holder's claim reports some of the file done (about 40% in)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the holder ended before it could be killed"
        with contextlib.suppress(Exception):
            body = s3(server).get_object(Bucket=bucket, Key=key)["Body"].read()
            claim = json.loads(body)
            if claim["done"] >= 0.4 * claim["size"]:
                return
        time.sleep(0.05)
    raise AssertionError("the holder never reported progress in its claim")


async def test_a_claim_that_makes_no_progress_is_given_up_on(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A holder that renews but never advances: the waiter downloads itself after
    ``claim_stall`` instead of waiting for ever."""
    first = model.path(model.shards[0]).read_bytes()
    key = claim_key(PREFIX, sha(first))
    stop = threading.Event()

    def stuck_holder() -> None:
        n = 0
        while not stop.is_set():
            now = time.time()
            body = {
                "version": 1,
                "holder": "stuck",
                "token": str(n),
                "size": len(first),
                "done": 10,
                "phase": "download",
                "renewed": now,
                "expires": now + 5,
            }
            s3(s3server).put_object(Bucket=s3bucket, Key=key, Body=json.dumps(body).encode())
            n += 1
            stop.wait(0.3)

    body = {"holder": "stuck", "size": len(first), "done": 10, "expires": time.time() + 5}
    s3(s3server).put_object(Bucket=s3bucket, Key=key, Body=json.dumps(body).encode())
    renewer = threading.Thread(target=stuck_holder, daemon=True)
    renewer.start()
    try:
        config = host(tmp_path / "h", hub, s3server, s3bucket, claim_lease=5.0, claim_stall=1.0)
        result = await prefetch(REPO, config)
    finally:
        stop.set()
        renewer.join()
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.stalled_fallbacks == 1
    assert sources(result, model)[0] == "network"


def test_tier_url_from_the_environment_and_config_errors(tmp_path: Path) -> None:
    from shardsync.config import load_config
    from shardsync.errors import ConfigError

    env = {"SHARDSYNC_TIER_URL": "s3://bucket/pre/", "HOME": str(tmp_path)}
    assert load_config(None, env).tier.url == "s3://bucket/pre/"
    for bad in ("http://x/y", "s3://", "s3://b/../x"):
        with pytest.raises(ConfigError):
            load_config(None, {**env, "SHARDSYNC_TIER_URL": bad})


async def test_the_daemon_reports_its_tier_in_status_and_metrics(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
) -> None:
    seed_tier(s3server, s3bucket, model, shards=3)
    with short_tmp() as work:
        config = host(work / "cache", hub, s3server, s3bucket)
        async with daemon_in_loop(config, work / "d" / "d.sock") as running:
            client_config = replace(config, daemon=running.config.daemon)
            async with Client(client_config, fallback="error") as client:
                result = await (await client.prefetch(REPO)).wait()
                status = await client.status()
            code, metrics = await api(running.socket_path, "GET", "/metrics")
        assert_snapshot_matches(result.snapshot_path, model)
    assert sources(result, model) == ["tier", "tier", "tier", "network"]
    tier = status["tier"]
    assert (tier["hits"], tier["misses"], tier["claims_won"]) == (3, 1, 1)
    assert tier["bytes_from_tier"] == sum(model.path(s).stat().st_size for s in model.shards[:3])
    assert code == 200
    assert "shardsync_tier_hits_total 3" in metrics.splitlines()
    for secret in (s3server.access_key, s3server.secret_key):
        assert secret not in json.dumps(status) and secret not in metrics
    assert f"shardsync_tier_bytes_total {tier['bytes_from_tier']}" in metrics.splitlines()


async def test_two_daemons_on_two_hosts_fetch_each_blob_from_the_hub_once(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
) -> None:
    hub.faults.add(Bandwidth(2_000_000))
    with short_tmp() as work:

        async def one_host(name: str) -> PrefetchResult:
            config = host(work / name, hub, s3server, s3bucket)
            async with daemon_in_loop(config, work / name / "d" / "d.sock") as running:
                client_config = replace(config, daemon=running.config.daemon)
                async with Client(client_config, fallback="error") as client:
                    return await (await client.prefetch(REPO)).wait()

        results = await asyncio.gather(one_host("a"), one_host("b"))
        for result in results:
            assert_snapshot_matches(result.snapshot_path, model)
    assert hub.bytes_served("*.safetensors") <= 1.05 * shard_bytes(model)
    assert [s for r in results for s in sources(r, model)].count("tier") == len(model.shards)


def client_config(path: Path, running: Daemon) -> Path:
    """What ``shardsync prefetch`` on a host reads: its daemon, which must answer."""
    cache, hub = running.config.cache_dir, running.config.endpoint
    path.write_text(
        f'[cache]\ndir = "{cache}"\n[hub]\nendpoint = "{hub}"\n'
        f'[daemon]\nsocket = "{running.socket_path}"\nfallback = "error"\n'
    )
    return path


async def prefetch_json(running: Daemon, work: Path) -> dict[str, Any]:
    """``shardsync prefetch --json`` as a user of the host runs it, through its daemon."""
    conf = client_config(work / f"client-{id(running)}.toml", running)
    out = await asyncio.to_thread(cli, "--config", str(conf), "prefetch", REPO, "--json")
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    assert Path(report["snapshot_path"]).is_relative_to(running.config.cache_dir)
    assert running.statistics().jobs_submitted == 1  # the daemon's job, not an in-process run
    return report


async def test_prefetch_json_through_the_daemon_gives_the_jobs_final_counters(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
) -> None:
    """The first host's daemon fetches every shard for the fleet and uploads it through a
    slow uplink: ``--json`` comes once the job's uploads are done, so they are all counted
    (as many as the Hub served shards); a second host's daemon then reads them all."""
    port = int(s3server.endpoint.rsplit(":", 1)[1])
    with short_tmp() as work:
        async with _Cut(("127.0.0.1", port), pace_up=0.02) as proxy:  # ~0.8 MB/s uplink
            via = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{proxy.port}"})
            config = host(work / "a", hub, via, s3bucket)
            async with daemon_in_loop(config, work / "a" / "d" / "d.sock") as first:
                report = await prefetch_json(first, work)
                served = hub.bytes_served("*.safetensors")
                in_tier = tier_objects(s3server, s3bucket)
                _, listing = await api(first.socket_path, "GET", "/v1/jobs")
        assert_snapshot_matches(Path(report["snapshot_path"]), model)
        assert served == shard_bytes(model)  # the Hub sent each shard once
        tier = report["tier"]
        assert tier["uploads"] == tier["misses"] == tier["claims_won"] == len(model.shards)
        assert tier["bytes_uploaded"] == served
        assert (tier["hits"], tier["bytes_from_tier"], tier["errors"]) == (0, 0, 0)
        assert in_tier == expected_tier(model)  # all up (and released) when --json was printed
        ((job,),) = listing.values()
        assert job["tier"] == tier and job["tier_final"]

        hub.reset_log()
        config = host(work / "b", hub, s3server, s3bucket)
        async with daemon_in_loop(config, work / "b" / "d" / "d.sock") as second:
            report = await prefetch_json(second, work)
        assert_snapshot_matches(Path(report["snapshot_path"]), model)
    assert hub.bytes_served("*.safetensors") == 0
    tier = report["tier"]
    assert tier["hits"] == len(model.shards)
    assert tier["bytes_from_tier"] == report["bytes_from_tier"] == shard_bytes(model)
    assert (tier["misses"], tier["uploads"], tier["claims_won"], tier["errors"]) == (0, 0, 0, 0)


async def test_two_jobs_at_once_in_one_daemon_each_count_their_own_tier_use(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """One job fetches its model for the fleet from a slow Hub while the other reads another
    model from the tier: each job's counters tell its own work, the daemon's their sum."""
    other = build_checkpoint(tmp_path / "other", total_bytes=2 << 20, n_shards=3, seed=7)
    hub.add_checkpoint("acme/other", other)
    seed_tier(s3server, s3bucket, other)
    hub.faults.add(Bandwidth(250_000, times=None, path="*.safetensors"))
    with short_tmp() as work:
        config = replace(host(work / "cache", hub, s3server, s3bucket), max_files=8)
        async with daemon_in_loop(config, work / "d" / "d.sock") as running:
            client_config = replace(config, daemon=running.config.daemon)
            async with Client(client_config, fallback="error") as client:
                jobs = [await client.prefetch(REPO), await client.prefetch("acme/other")]
                results = await asyncio.gather(*(job.wait() for job in jobs))
                fetching, reading = await asyncio.gather(*(job.wait_tier() for job in jobs))
                infos = [await job.refresh() for job in jobs]
                status = await client.status()
        assert_snapshot_matches(results[0].snapshot_path, model)
        assert_snapshot_matches(results[1].snapshot_path, other)
    first, second = infos
    assert (
        first["started_at"] < second["finished_at"] and second["started_at"] < first["finished_at"]
    )
    assert fetching is not None and reading is not None
    assert fetching.misses == fetching.claims_won == fetching.uploads == len(model.shards)
    assert fetching.bytes_uploaded == shard_bytes(model)
    assert (fetching.hits, fetching.bytes_from_tier) == (0, 0)
    assert reading.hits == len(other.shards)
    assert reading.bytes_from_tier == shard_bytes(other)
    assert (reading.misses, reading.claims_won, reading.uploads) == (0, 0, 0)
    assert first["tier"]["uploads"] == fetching.uploads and second["tier"]["hits"] == reading.hits
    daemon_wide = status["tier"]
    for name in ("hits", "misses", "bytes_from_tier", "uploads", "bytes_uploaded", "claims_won"):
        assert daemon_wide[name] == getattr(fetching, name) + getattr(reading, name), name


def test_a_jobs_tier_object_reads_back_and_nonsense_is_refused() -> None:
    """What a client makes of a daemon's job: its counters as they were, a newer daemon's
    extra field ignored, and anything else refused rather than printed as counts."""
    stats = TierStatistics("s3://b/p/", *range(1, 12), disabled=False, read_only=True)
    assert TierStatistics.from_json({**asdict(stats), "newer": 1}) == stats
    for bad in (
        [],
        {**asdict(stats), "hits": -1},
        {**asdict(stats), "hits": True},
        {**asdict(stats), "uploads": "4"},
        {**asdict(stats), "read_only": 0},
        {k: v for k, v in asdict(stats).items() if k != "errors"},
    ):
        with pytest.raises(ValueError):
            TierStatistics.from_json(bad)


async def test_the_snapshot_is_reported_complete_while_its_uploads_go_on(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A holder's process tells its user the snapshot is complete at once; the fleet's
    uploads (here through a slow uplink) finish before ``prefetch`` returns."""
    port = int(s3server.endpoint.rsplit(":", 1)[1])
    seen: list[tuple[PrefetchResult, int]] = []
    async with _Cut(("127.0.0.1", port), pace_up=0.02) as proxy:  # ~0.8 MB/s uplink
        via = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{proxy.port}"})
        config = host(tmp_path / "h", hub, via, s3bucket)

        def complete(result: PrefetchResult) -> None:
            blobs = [
                k for k in tier_objects(s3server, s3bucket) if k.startswith(PREFIX + "sha256/")
            ]
            seen.append((result, len(blobs)))

        result = await prefetch(REPO, config, on_complete=complete)
    ((early, in_tier_then),) = seen
    assert_snapshot_matches(early.snapshot_path, model)  # complete when reported
    assert in_tier_then < len(model.shards)  # the uploads were still going on
    assert result.tier is not None and result.tier.uploads == len(model.shards)
    assert tier_objects(s3server, s3bucket) == expected_tier(model)  # all up on return


async def test_a_tier_that_hangs_during_the_uploads_costs_seconds_at_the_end(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """The tier takes the uploads' requests and never answers them (a hung gateway): the
    snapshot is complete, and ``prefetch`` returns within an upload's deadline (5 s and
    the blob's size at ``upload_floor``), where it waited on the uploads for as long as the
    tier said nothing."""
    done_at: list[float] = []
    async with FaultGate(s3server.endpoint, slow_puts=("/sha256/", 3600)) as gate:
        via = S3Server(**{**s3server.__dict__, "endpoint": gate.endpoint})
        config = host(tmp_path / "h", hub, via, s3bucket)
        result = await prefetch(
            REPO, config, on_complete=lambda _: done_at.append(time.monotonic())
        )
        waited = time.monotonic() - done_at[0]
    assert_snapshot_matches(result.snapshot_path, model)
    assert waited < 5 + 2 * (1 << 20) / config.tier.upload_floor + 2, waited
    assert result.tier is not None and result.tier.uploads == 0 and result.tier.errors >= 1


async def test_a_claim_renewal_the_tier_never_answers_is_given_up_and_renewals_go_on(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A renewal is one request the tier may take and never answer (a hung gateway): it is
    given up within seconds and counted, and the next ones still keep the claim alive,
    where a renewal waiting on its answer for ever ended every renewal of that claim."""
    hub.faults.add(Bandwidth(150_000))  # about 7 s for the model on 4 connections
    async with FaultGate(s3server.endpoint, stall_renewals=1) as gate:
        via = S3Server(**{**s3server.__dict__, "endpoint": gate.endpoint})
        config = host(tmp_path / "h", hub, via, s3bucket, claim_lease=1.0)
        result = await asyncio.wait_for(prefetch(REPO, config), 60)
        renewals = [
            s
            for s in gate.seen
            if s.method == "PUT" and "/claims/" in s.target and "if-match" in s.headers
        ]
    assert_snapshot_matches(result.snapshot_path, model)
    stalled = [s.at for s in renewals if s.fault == "stall"]
    assert len(stalled) == 1
    assert [s for s in renewals if s.at > stalled[0] + 4 and s.status == 200], "renewals ended"
    assert result.tier is not None and result.tier.errors >= 1


async def test_a_blip_at_the_holder_still_serves_its_waiters_from_the_tier(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A claim's first renewal answered 503 twice (a tier that blips, then answers): the
    holder takes the tier for down a while (its next files go to the origin alone), yet its
    later renewals keep its claims, so it must still upload what they promise. It gave the
    uploads up instead: the waiters waited out the whole download, then took each claim
    over and fetched a second copy."""
    hub.faults.add(Bandwidth(500_000))  # about 2 s a shard: the waiter comes while it runs
    async with FaultGate(s3server.endpoint, fail_renewals=2) as gate:
        via = S3Server(**{**s3server.__dict__, "endpoint": gate.endpoint})
        holder = asyncio.create_task(prefetch(REPO, host(tmp_path / "a", hub, via, s3bucket)))

        def blipped() -> int:  # renewals answered 503: each claim's two, its holder's own
            return sum(1 for s in gate.seen if "/claims/" in s.target and s.status == 503)

        await until(lambda: blipped() >= 2 or holder.done())  # a claim's two: the tier is down
        waiter = await prefetch(REPO, host(tmp_path / "b", hub, s3server, s3bucket))
        held = await holder
    assert [s.status for s in gate.seen if s.status == 503]  # the blip happened
    assert held.tier is not None and held.tier.claims_won >= 1  # more, if won before the blip
    assert held.tier.uploads == held.tier.claims_won  # what its live claims promised
    assert waiter.tier is not None and waiter.tier.claims_taken_over == 0
    assert waiter.tier.hits >= held.tier.claims_won  # read from the tier, not fetched again
    assert_snapshot_matches(waiter.snapshot_path, model)


@pytest.mark.parametrize(
    "body",
    [
        b"not json at all",
        json.dumps({"done": "lots", "size": "big", "expires": 1e300, "phase": 7}).encode(),
        json.dumps({"done": True, "expires": "never"}).encode(),
        json.dumps([1, 2, 3]).encode(),
    ],
)
async def test_a_garbage_claim_never_breaks_a_host(
    body: bytes,
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    hub: FakeHub,
    aws_env: None,
    tmp_path: Path,
) -> None:
    """A claim object is another host's word, never trusted: one that cannot be read, or
    says nonsense, is waited on at most a lease, then taken over."""
    first = model.path(model.shards[0]).read_bytes()
    s3(s3server).put_object(Bucket=s3bucket, Key=claim_key(PREFIX, sha(first)), Body=body)
    config = host(tmp_path / "h", hub, s3server, s3bucket, claim_lease=1.0, claim_stall=30.0)
    result = await asyncio.wait_for(prefetch(REPO, config), 60)
    assert_snapshot_matches(result.snapshot_path, model)
    assert result.tier is not None and result.tier.claims_taken_over == 1
    assert tier_objects(s3server, s3bucket) == expected_tier(model)


def test_a_waiters_judgement_of_a_claim_runs_on_its_own_clock() -> None:
    """Pure: dead after a lease without a new ETag (or by its own stamp), stalled after
    ``stall`` without progress, an upload allowed its size at the floor rate on top."""

    def claim(done: object, phase: str = "download", expires_in: float = 60.0) -> bytes:
        return json.dumps(
            {"done": done, "phase": phase, "expires": time.time() + expires_in}
        ).encode()

    def watch() -> Watch:
        return Watch(size=1000, lease=4.0, stall=10.0, upload_floor=100, started=0.0)

    w = watch()
    assert w.look(claim(300), "a", 1.0) == 300
    assert w.look(claim(5000), "b", 2.0) == 1000  # another host's word, clamped to the size
    assert w.look(claim(1000), "b", 6.0) == 1000  # four seconds of one ETag: still alive
    assert w.look(claim(1000), "b", 6.1) == "dead"
    assert watch().look(claim(0, expires_in=-61.0), "a", 0.0) == "dead"  # its own stamp
    assert watch().look(b"not json", "a", 0.0) == "dead"

    w = watch()
    assert w.look(claim(10), "e0", 0.0) == 10
    for t in range(1, 11):  # renewed every second, never further than 10 bytes
        assert w.look(claim(True if t % 2 else 10), f"e{t}", float(t)) == 10
    assert w.look(claim(10), "e11", 10.5) == "stalled"

    w = watch()
    assert w.look(claim(1000, "upload"), "u0", 0.0) == 1000
    assert w.look(claim(1000, "upload"), "u1", 19.0) == 1000  # 10 s + 1000 B at 100 B/s
    assert w.look(claim(1000, "upload"), "u2", 20.5) == "stalled"


def test_a_full_disk_with_a_tier_is_the_same_one_error_line(
    s3server: S3Server, s3bucket: str, aws_env: None, tmp_path: Path
) -> None:
    """The cache's disk fills while the tier is on: exit 8 and one ``no space left`` line, as
    without a tier; no traceback, no unclosed session, nothing unverified published."""
    big = build_checkpoint(tmp_path / "big", total_bytes=40 << 20, n_shards=4, seed=5)
    conf = tmp_path / "shardsync.toml"
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\nregion = "{s3server.region}"\n'
        f'addressing = "path"\n[tier]\nurl = "s3://{s3bucket}/{PREFIX}"\n'
        "[retry]\nbase_delay = 0.01\nmax_delay = 0.1\n"
    )
    with serving({REPO: big}) as fake, tmpfs(tmp_path / "small", "size=10m") as cache:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "shardsync.cli", "prefetch", REPO),
                *("--config", str(conf), "--endpoint", fake.endpoint, "--cache-dir", str(cache)),
                *("--no-daemon", "--quiet"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONWARNINGS": "always"},
        )
        assert out.returncode == 8, out.stderr
        assert "Traceback" not in out.stderr and "Unclosed" not in out.stderr, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("shardsync: error: no space left on device"), out.stderr
        assert_store_verified(cache, big)


def test_prefetch_json_gives_the_tiers_final_counters(
    s3server: S3Server, s3bucket: str, aws_env: None, model: Checkpoint, tmp_path: Path
) -> None:
    """``--json`` is printed once the uploads the fleet is owed are done, so its ``tier``
    object counts each of them: as many uploads and bytes as the tier then holds."""
    conf = tmp_path / "shardsync.toml"
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\nregion = "{s3server.region}"\n'
        f'addressing = "path"\n[tier]\nurl = "s3://{s3bucket}/{PREFIX}"\n'
    )
    with serving({REPO: model}) as fake:
        out = subprocess.run(
            [
                *(sys.executable, "-m", "shardsync.cli", "prefetch", REPO, "--json"),
                *("--config", str(conf), "--endpoint", fake.endpoint),
                *("--cache-dir", str(tmp_path / "cache"), "--no-daemon", "--quiet"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    tier = json.loads(out.stdout)["tier"]
    assert tier_objects(s3server, s3bucket) == expected_tier(model)
    assert tier["uploads"] == len(model.shards)
    assert tier["bytes_uploaded"] == shard_bytes(model)
    assert tier["errors"] == 0
