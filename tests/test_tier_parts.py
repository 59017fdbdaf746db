"""A claim holder's parts in the tier (``shardsync.tier_parts``), against a real SeaweedFS: a
host taking over a dead holder's claim resumes from the blocks it published, downloads only
the rest from the Hub, and never trusts a part it did not hash.

Every check compares with the bytes the Hub holds and the bytes it served.
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from faultgate import FaultGate
from helpers import (
    assert_snapshot_matches,
    fast_config,
    open_under,
    s3,
    s3_keys,
    serving,
    until,
)

from shardsync.cache import CacheStore
from shardsync.config import Config, S3Config, TierConfig
from shardsync.names import S3Location
from shardsync.prefetch import Engine, prefetch
from shardsync.ranges import RangeSet
from shardsync.records import PrefetchResult
from shardsync.s3 import S3Client
from shardsync.slot import Seeding, Slot
from shardsync.testing import Bandwidth, Checkpoint, FakeHub, build_checkpoint
from shardsync.testing.seaweedfs import S3Server
from shardsync.tier_claims import blob_key, claim_key
from shardsync.tier_parts import Lead, next_pieces, parts_prefix, seed_from_parts

REPO = "acme/parts"
PREFIX = "fleet/"
PART = 5 << 20  # S3's smallest part: three parts per 12 MiB shard


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """Two shards of ~12 MiB."""
    return build_checkpoint(tmp_path_factory.mktemp("parts"), total_bytes=24 << 20, n_shards=2)


def host(cache_dir: Path, hub: FakeHub, server: S3Server, bucket: str) -> Config:
    s3 = S3Config(endpoint=server.endpoint, region=server.region, addressing="path")
    return replace(
        fast_config(cache_dir, hub.endpoint),
        s3=s3,
        tier=TierConfig(url=f"s3://{bucket}/{PREFIX}", part_size=PART),
    )


def dead_holder(server: S3Server, bucket: str, data: bytes, parts: int, flip: bool = False) -> str:
    """What a holder killed after publishing ``parts`` blocks leaves: its expired claim and the
    blocks (one byte flipped in the last, with ``flip``). The blob's sha256."""
    sha = hashlib.sha256(data).hexdigest()
    now = time.time()
    claim = {
        "version": 1,
        "holder": "dead:1",
        "token": "0",
        "size": len(data),
        "done": parts * PART,
        "phase": "download",
        "renewed": now - 120,
        "expires": now - 100,
    }
    client = s3(server)
    client.put_object(Bucket=bucket, Key=claim_key(PREFIX, sha), Body=json.dumps(claim).encode())
    for n in range(parts):
        start, end = n * PART, min((n + 1) * PART, len(data))
        body = bytearray(data[start:end])
        if flip and n == parts - 1:
            body[len(body) // 2] ^= 0x01
        key = f"{parts_prefix(PREFIX, sha)}{start}-{end}"
        client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    return sha


def ranges(*pairs: tuple[int, int]) -> RangeSet:
    out = RangeSet()
    for first, stop in pairs:
        out.add(first, stop)
    return out


@pytest.mark.parametrize(
    ("landed", "published", "flush", "pieces"),
    [
        # each connection's run, in whole pieces; its growing tail waits
        ([(0, 9), (20, 27)], [], False, [(0, 4), (4, 8), (20, 24)]),
        # ... until a flush: then the tails go too
        ([(0, 9), (20, 27)], [], True, [(0, 4), (4, 8), (8, 9), (20, 24), (24, 27)]),
        ([(0, 9)], [(0, 8)], True, [(8, 9)]),
        # a run that reached a published piece (or the end) can grow no more: all of it goes
        ([(0, 9)], [(9, 12)], False, [(0, 4), (4, 8), (8, 9)]),
        ([(30, 40)], [], False, [(30, 34), (34, 38), (38, 40)]),
        # nothing twice
        ([(0, 12)], [(0, 8)], False, [(8, 12)]),
        ([(0, 6)], [(0, 4)], False, []),
        ([(0, 6)], [(0, 6)], True, []),
    ],
)
def test_a_holder_publishes_whole_pieces_of_what_landed_once(
    landed: list[tuple[int, int]],
    published: list[tuple[int, int]],
    flush: bool,
    pieces: list[tuple[int, int]],
) -> None:
    assert next_pieces(ranges(*landed), ranges(*published), 40, 4, flush=flush) == pieces


def outcome(result: PrefetchResult, path: str) -> tuple[int, int]:
    """(bytes from the network, bytes resumed) of one file."""
    (file,) = [f for f in result.files if f.path == path]
    return file.downloaded, file.resumed


async def test_a_taker_resumes_from_the_dead_holders_parts(
    s3server: S3Server, s3bucket: str, model: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    dead_holder(s3server, s3bucket, data, parts=2)
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        result = await prefetch(REPO, host(tmp_path / "taker", hub, s3server, s3bucket))
        served = hub.bytes_served(shard)
    assert_snapshot_matches(result.snapshot_path, model)
    assert served == len(data) - 2 * PART  # the Hub sent only what the parts did not hold
    assert outcome(result, shard)[1] == 2 * PART
    assert result.tier is not None and result.tier.claims_taken_over == 1
    assert result.tier.bytes_from_parts == 2 * PART
    # the blob is in the tier; its parts are gone with the claim
    sha = hashlib.sha256(data).hexdigest()
    assert s3(s3server).get_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha))["Body"].read() == (
        data
    )
    assert not {k for k in s3_keys(s3server, s3bucket, PREFIX) if "/parts/" in k or "/claims/" in k}


async def test_a_taker_never_uploads_again_the_parts_it_resumed_from(
    s3server: S3Server, s3bucket: str, model: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """The dead holder's parts stay as it left them while the taker downloads the rest: the
    tier holds those bytes already, and the takeover is when its uploads matter most."""
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    prefix = parts_prefix(PREFIX, dead_holder(s3server, s3bucket, data, parts=2))
    seeded = {f"{prefix}0-{PART}", f"{prefix}{PART}-{2 * PART}"}

    def stamps() -> dict[str, Any]:
        pages = (
            s3(s3server).get_paginator("list_objects_v2").paginate(Bucket=s3bucket, Prefix=prefix)
        )
        return {o["Key"]: o["LastModified"] for page in pages for o in page.get("Contents", ())}

    before = stamps()
    await asyncio.sleep(1.1)  # a PUT now would change LastModified (one second's resolution)
    seen: list[dict[str, Any]] = []
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        hub.faults.add(Bandwidth(1_000_000, path=shard))  # the rest takes a second or more
        task = asyncio.create_task(
            prefetch(REPO, host(tmp_path / "taker", hub, s3server, s3bucket))
        )
        while not task.done():
            seen.append(await asyncio.to_thread(stamps))
            await asyncio.sleep(0.1)
        result = await task
    assert_snapshot_matches(result.snapshot_path, model)
    assert outcome(result, shard)[1] == 2 * PART
    assert len(seen) >= 8  # the publisher looked several times while the rest downloaded
    assert all(s.get(key, before[key]) == before[key] for s in seen for key in seeded)


@pytest.mark.parametrize("attempts", [1, 3], ids=["one-attempt", "shipped-attempts"])
async def test_a_corrupt_part_costs_one_download_and_never_a_wrong_blob(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    attempts: int,
) -> None:
    """A dead holder's part with a flipped byte: the taker's seeded download fails its hash,
    the parts are deleted (counted corrupt) and the file comes whole from the origin. With
    the shipped ``max_verify_attempts`` (3) the fetcher downloaded again on its own and the
    tier never learned of the bad part, which stayed for the next taker."""
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    dead_holder(s3server, s3bucket, data, parts=2, flip=True)
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        config = host(tmp_path / "taker", hub, s3server, s3bucket)
        config = replace(config, fetch=replace(config.fetch, max_verify_attempts=attempts))
        result = await prefetch(REPO, config)
        served = hub.bytes_served(shard)
    assert_snapshot_matches(result.snapshot_path, model)
    assert served == 2 * len(data) - 2 * PART  # the seeded try, then the whole file again
    assert result.tier is not None and result.tier.corrupt_objects == 1
    assert result.tier.bytes_from_parts == 0
    assert not {k for k in s3_keys(s3server, s3bucket, PREFIX) if "/parts/" in k}
    sha = hashlib.sha256(data).hexdigest()
    assert s3(s3server).get_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha))["Body"].read() == (
        data
    )


async def test_a_wrong_seeded_partial_never_costs_the_tier_a_good_object(
    s3server: S3Server, s3bucket: str, model: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """A taker killed after seeding from a dead holder's wrong part leaves that partial; by its
    next run another host has uploaded the good blob. The tier read resumes from the partial,
    and its mismatch is the partial's: the read starts again from zero, and the good object,
    which every host of the fleet reads, is not deleted as corrupt."""
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    sha = dead_holder(s3server, s3bucket, data, parts=2, flip=True)
    cache = tmp_path / "taker"
    where = S3Location(s3bucket, PREFIX)
    client = S3Client(
        S3Config(endpoint=s3server.endpoint, region=s3server.region, addressing="path")
    )
    try:  # the seeding of the killed run, which got no further
        seeded = await seed_from_parts(client, where, sha, len(data), Slot(CacheStore(cache), sha))
    finally:
        await client.aclose()
    assert seeded.total() == 2 * PART
    for key in s3_keys(s3server, s3bucket, PREFIX):  # another host finished the blob
        s3(s3server).delete_object(Bucket=s3bucket, Key=key)
    s3(s3server).put_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha), Body=data)
    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        result = await prefetch(REPO, host(cache, hub, s3server, s3bucket))
        served = hub.bytes_served(shard)
    assert_snapshot_matches(result.snapshot_path, model)
    assert served == 0  # every byte of the shard came from the tier
    assert result.tier is not None and result.tier.corrupt_objects == 0
    body = s3(s3server).get_object(Bucket=s3bucket, Key=blob_key(PREFIX, sha))["Body"].read()
    assert body == data


@pytest.mark.parametrize("part_size", ["1MiB", "16MiB"])
def test_a_holder_killed_mid_download_leaves_parts_the_taker_resumes_from(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    part_size: str,
) -> None:
    """A real holder, killed ``-9`` once its claim says 60% of the first shard is done: what it
    published is not downloaded again (the Hub's egress for that shard stays under 1.5 of it).
    With pieces larger than the shard, only the holder's flushes of its runs' tails publish."""
    conf = tmp_path / "shardsync.toml"
    conf.write_text(
        f'[s3]\nendpoint = "{s3server.endpoint}"\naddressing = "path"\nregion = "us-east-1"\n'
        f'[tier]\nurl = "s3://{s3bucket}/{PREFIX}"\nclaim_lease = "1s"\npart_size = "{part_size}"\n'
        '[download]\nconnections_per_file = 2\nchunk_size = "4MiB"\n'
    )
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    with serving({REPO: model}) as fake:
        fake.faults.add(Bandwidth(1_500_000))  # ~4 s per shard on 2 connections
        env = {**os.environ, "HF_ENDPOINT": fake.endpoint}
        holder = subprocess.Popen(
            [sys.executable, "-m", "shardsync.cli", "--config", str(conf), "prefetch", REPO,
             "--cache-dir", str(tmp_path / "holder"), "--no-daemon", "--quiet"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for_parts(s3server, s3bucket, sha, holder, len(data))
        finally:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
        fake.faults.clear()
        deadline = time.monotonic() + 10  # the server counts a body's bytes until it ends
        while fake.in_flight()[shard] and time.monotonic() < deadline:
            time.sleep(0.01)
        by_holder = fake.bytes_served(shard)
        published = sum(
            int(k.rsplit("-", 1)[1]) - int(k.rsplit("/", 1)[1].split("-")[0])
            for k in s3_keys(s3server, s3bucket, parts_prefix(PREFIX, sha))
        )
        config = replace(
            fast_config(tmp_path / "taker", fake.endpoint),
            s3=S3Config(endpoint=s3server.endpoint, region=s3server.region, addressing="path"),
            tier=TierConfig(url=f"s3://{s3bucket}/{PREFIX}", claim_lease=1.0, part_size=PART),
        )
        result = asyncio.run(prefetch(REPO, config))
        by_taker = fake.bytes_served(shard) - by_holder
    assert_snapshot_matches(result.snapshot_path, model)
    assert published >= 0.3 * len(data)  # less than a piece per connection was lost
    assert outcome(result, shard)[1] == published
    assert by_taker == len(data) - published
    assert by_holder + by_taker < 1.5 * len(data)


async def _cancel_a_seeding(
    server: S3Server,
    bucket: str,
    sha: str,
    size: int,
    slot: Slot,
    entered: threading.Event,
    release: threading.Event,
) -> None:
    """Seed ``slot`` from the dead holder's parts, cancel the seeding once a step of it held
    in its thread (``entered``) runs, and let that step go 0.3 s later: a cleanup that does
    not wait for it runs meanwhile."""
    client = S3Client(S3Config(endpoint=server.endpoint, region=server.region, addressing="path"))
    try:
        where = S3Location(bucket, PREFIX)
        seeding = asyncio.create_task(seed_from_parts(client, where, sha, size, slot))
        assert await asyncio.to_thread(entered.wait, 10)
        seeding.cancel()
        await asyncio.sleep(0.3)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await seeding
    finally:
        release.set()
        await client.aclose()


async def test_a_cancelled_seeding_closes_its_partial_only_after_its_writes(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel cannot stop a part's write in its thread: the partial's descriptor is closed
    once every write ended, never under one (a closed descriptor's number is the next file
    opened's, and the late write would land in that file), and what was written is claimed."""
    data = os.urandom(2 * PART)
    sha = dead_holder(s3server, s3bucket, data, parts=2)
    entered, release = threading.Event(), threading.Event()
    events: list[str] = []
    write, close = Seeding.write, Seeding.close

    def held_write(self: Seeding, offset: int, piece: bytes) -> None:
        entered.set()
        release.wait(10)
        write(self, offset, piece)
        events.append("wrote")

    def noted_close(self: Seeding) -> None:
        events.append("closed")
        close(self)

    monkeypatch.setattr(Seeding, "write", held_write)
    monkeypatch.setattr(Seeding, "close", noted_close)
    slot = Slot(CacheStore(tmp_path / "cache"), sha)
    await _cancel_a_seeding(s3server, s3bucket, sha, len(data), slot, entered, release)
    assert events[-1] == "closed" and events.count("wrote") >= 1, events
    landed = slot.landed()
    assert landed is not None and landed.total() >= PART
    for first, stop in landed.to_list():
        assert slot.read(first, stop - first) == data[first:stop]


async def test_a_seeding_cancelled_while_its_partial_is_made_leaves_no_descriptor_open(
    s3server: S3Server,
    s3bucket: str,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cancel cannot stop the thread that makes the seeded partial: what it opened is
    closed once it ends (else the partial's descriptor and its record's stay open for the
    life of the process, two more for every job cancelled there), and the partial stays
    for a download to resume."""
    data = os.urandom(2 * PART)
    sha = dead_holder(s3server, s3bucket, data, parts=2)
    entered, release, made = threading.Event(), threading.Event(), threading.Event()
    seed = Slot.seed

    def held_seed(self: Slot, size: int, sha256: str) -> Seeding | None:
        entered.set()
        release.wait(10)
        try:
            return seed(self, size, sha256)
        finally:
            made.set()

    monkeypatch.setattr(Slot, "seed", held_seed)
    cache = tmp_path / "cache"
    slot = Slot(CacheStore(cache), sha)
    await _cancel_a_seeding(s3server, s3bucket, sha, len(data), slot, entered, release)
    assert await asyncio.to_thread(made.wait, 10)
    assert open_under(cache) == []
    landed = slot.landed()
    assert landed is not None and landed.total() == 0  # resumable, nothing claimed


async def test_a_taker_cancelled_while_it_seeds_lets_go_of_the_claim(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job cancelled (or failing: a full disk) while it seeds from a dead holder's parts
    let go of nothing: its claim was renewed for as long as the engine lived (a daemon's:
    for ever), so no host took the blob over and each waited out the stall instead."""
    shard = model.shards[0]
    sha = dead_holder(s3server, s3bucket, model.path(shard).read_bytes(), parts=2)
    entered, release = threading.Event(), threading.Event()
    write = Seeding.write

    def held_write(self: Seeding, offset: int, piece: bytes) -> None:
        entered.set()
        release.wait(10)
        write(self, offset, piece)

    monkeypatch.setattr(Seeding, "write", held_write)

    def claim_etag() -> str | None:
        key = claim_key(PREFIX, sha)
        with contextlib.suppress(Exception):  # none: the claim was let go
            return str(s3(s3server).head_object(Bucket=s3bucket, Key=key)["ETag"])
        return None

    async with FakeHub() as hub:
        hub.add_checkpoint(REPO, model)
        async with Engine(host(tmp_path / "taker", hub, s3server, s3bucket)) as engine:
            job = engine.job(engine.origin(REPO))

            async def download() -> None:
                await job.prepare(None, ())
                await job.download()

            task = asyncio.create_task(download())
            try:
                assert await asyncio.to_thread(entered.wait, 30)
                task.cancel()
            finally:
                release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            first = await asyncio.to_thread(claim_etag)
            await asyncio.sleep(2.5)  # the claim renews every 0.8 s while it is held
            assert first is None or await asyncio.to_thread(claim_etag) == first


def _wait_for_parts(
    server: S3Server, bucket: str, sha: str, proc: subprocess.Popen[bytes], size: int
) -> None:
    """Until the holder's claim says 60% done and at least one part is published."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the holder ended before it could be killed"
        with contextlib.suppress(Exception):
            body = s3(server).get_object(Bucket=bucket, Key=claim_key(PREFIX, sha))["Body"].read()
            parts = s3_keys(server, bucket, parts_prefix(PREFIX, sha))
            if json.loads(body)["done"] >= 0.6 * size and parts:
                return
        time.sleep(0.05)
    raise AssertionError("the holder never published a part")


async def test_a_tier_dying_while_parts_go_up_costs_one_warning(
    s3server: S3Server,
    s3bucket: str,
    model: Checkpoint,
    aws_env: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The tier dies once the holder has published parts: the job ends from the origin with
    one warning, no error of the parts' own (their uploads run four at a time)."""
    from test_tier import _Cut

    port = int(s3server.endpoint.rsplit(":", 1)[1])
    shard = model.shards[0]
    data = model.path(shard).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    async with FakeHub() as hub, _Cut(("127.0.0.1", port)) as proxy:
        hub.add_checkpoint(REPO, model)
        hub.faults.add(Bandwidth(2_000_000))
        via = S3Server(**{**s3server.__dict__, "endpoint": f"http://127.0.0.1:{proxy.port}"})
        config = host(tmp_path / "h", hub, via, s3bucket)
        config = replace(config, tier=replace(config.tier, part_size=1 << 20))

        def cut_once_parts_are_up(n: int) -> float:
            if not proxy.down and hub.bytes_served(shard) > 0.5 * len(data):
                with contextlib.suppress(Exception):
                    if s3_keys(s3server, s3bucket, parts_prefix(PREFIX, sha)):
                        proxy.cut()
            return 0.0

        with caplog.at_level(logging.WARNING, logger="shardsync.tier"):
            async with Engine(config, throttle=cut_once_parts_are_up) as engine:
                job = engine.job(engine.origin(REPO))
                await job.prepare()
                files = await job.download()
                snapshot, tier = job.snapshot_path, engine.tier
    assert proxy.down and tier is not None
    assert_snapshot_matches(snapshot, model)
    assert [f.source for f in files if f.path in model.shards] == ["network"] * 2
    assert len([r for r in caplog.records if r.name == "shardsync.tier"]) == 1


def test_a_lead_holds_the_download_while_too_much_is_not_in_the_tier() -> None:
    now = [0.0]
    lead = Lead(10, patience=5.0, clock=lambda: now[0])
    assert lead(10) == 0 and not lead.held  # up to the limit: on
    assert lead(1) > 0 and lead.held  # one byte beyond: the reader waits
    now[0] = 4.0
    assert lead(0) > 0  # ... however long the tier takes, within its patience
    lead.settled(6)
    assert lead(0) == 0 and not lead.held  # the tier took a part: on again
    assert lead(7) > 0
    now[0] = 8.9
    lead.settled(1)  # progress, however little, restarts the patience
    now[0] = 13.8
    assert lead(0) > 0
    now[0] = 14.0
    assert lead(0) == 0 and not lead.held  # 5 s without a part: the download goes on alone
    assert lead(100) == 0  # ... for good


def test_a_released_lead_never_holds() -> None:
    lead = Lead(10)
    assert lead(11) > 0
    lead.release()
    assert lead(0) == 0 and lead(1 << 30) == 0 and not lead.held


SMALL_PART = 1 << 20  # the smallest part_size: the lead is 8 MiB


def paced_host(
    cache_dir: Path, hub: FakeHub, server: S3Server, gate: FaultGate, bucket: str
) -> Config:
    """A host whose tier is behind ``gate``, with 1 MiB parts and 2 connections per file."""
    via = S3Server(**{**server.__dict__, "endpoint": gate.endpoint})
    config = host(cache_dir, hub, via, bucket)
    return replace(
        config,
        tier=replace(config.tier, part_size=SMALL_PART),
        fetch=replace(config.fetch, connections_per_file=2),
    )


@pytest.fixture(scope="module")
def one_large(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """One shard of ~24 MiB."""
    return build_checkpoint(tmp_path_factory.mktemp("lead"), total_bytes=24 << 20, n_shards=1)


async def test_a_holder_stays_within_its_lead_of_a_slow_tier(
    s3server: S3Server, s3bucket: str, one_large: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """A tier that takes parts slower than the origin sends them: the holder's download waits
    for them, so at no moment has the Hub sent more than the lead (plus what the sockets
    hold) beyond the parts in the tier, which is what a ``kill -9`` would cost."""
    shard = one_large.shards[0]
    data = one_large.path(shard).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    part = SMALL_PART
    ahead: list[int] = []
    async with FakeHub() as hub, FaultGate(s3server.endpoint, slow_puts=("/parts/", 1.5)) as gate:
        hub.add_checkpoint(REPO, one_large)
        hub.faults.add(Bandwidth(4_000_000))  # 8 MB/s on 2 connections; the tier: 2.7 MiB/s
        config = paced_host(tmp_path / "h", hub, s3server, gate, s3bucket)

        def in_tier() -> int:
            keys = s3_keys(s3server, s3bucket, parts_prefix(PREFIX, sha))
            return sum(e - b for b, e in (map(int, k.rsplit("/", 1)[1].split("-")) for k in keys))

        async def watch() -> None:
            while True:
                served = hub.bytes_served(shard)
                parts = await asyncio.to_thread(in_tier)
                if 0 < served < len(data):  # the parts go once the whole file is in
                    ahead.append(served - parts)
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        try:
            result = await prefetch(REPO, config)
        finally:
            watcher.cancel()
        served = hub.bytes_served(shard)
    assert_snapshot_matches(result.snapshot_path, one_large)
    assert served == len(data)
    assert len(ahead) > 20  # the watch saw the download, not only its end
    assert max(ahead) <= Lead.of_parts(part).limit + 3 * part  # 8.5 MiB seen; unpaced 19


async def test_a_held_download_is_cancelled_at_once(
    s3server: S3Server, s3bucket: str, one_large: Checkpoint, aws_env: None, tmp_path: Path
) -> None:
    """A job cancelled while its download waits for a tier that takes no part: the pump stops
    waiting at the abort, so the job ends in moments, not after the lead's patience (5 s)
    or the part uploads' 30 s."""
    shard = one_large.shards[0]
    part = SMALL_PART
    async with FakeHub() as hub, FaultGate(s3server.endpoint, slow_puts=("/parts/", 30)) as gate:
        hub.add_checkpoint(REPO, one_large)
        hub.faults.add(Bandwidth(4_000_000))
        config = paced_host(tmp_path / "h", hub, s3server, gate, s3bucket)
        job = asyncio.ensure_future(prefetch(REPO, config))
        async with asyncio.timeout(30):
            await until(lambda: hub.bytes_served(shard) >= Lead.of_parts(part).limit)
        await asyncio.sleep(0.5)  # held: the tier has taken nothing
        served = hub.bytes_served(shard)
        began = time.monotonic()
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job
        took = time.monotonic() - began
    assert served < len(one_large.path(shard).read_bytes())  # it was held, not done
    assert took < 3.0  # 0.03 s seen; deaf to the abort, 4.5 s
