"""shardsync.Client and SyncClient: through a daemon, and in-process when none answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from daemons import daemon_in_loop, short_tmp
from helpers import assert_snapshot_matches, fast_config

import shardsync
from shardsync import errors
from shardsync.client import Client, SyncClient
from shardsync.daemon import Daemon
from shardsync.events import JobDone, Verified
from shardsync.prefetch import prefetch
from shardsync.prepared import Prepared
from shardsync.records import FileOutcome, PrefetchResult
from shardsync.testing import Bandwidth, Checkpoint, FakeHub

REPO = "acme/client"


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


@pytest.fixture
def hub(fake_hub: FakeHub, checkpoint: Checkpoint) -> FakeHub:
    fake_hub.add_checkpoint(REPO, checkpoint)
    return fake_hub


@pytest.fixture
async def daemon(hub: FakeHub, workdir: Path) -> AsyncIterator[Daemon]:
    config = fast_config(workdir / "daemon-cache", hub.endpoint)
    async with daemon_in_loop(config, workdir / "shardsync" / "d.sock") as running:
        yield running


def _no_daemon(workdir: Path) -> Path:
    return workdir / "nothing-here" / "d.sock"


def _identity(result: PrefetchResult) -> tuple[object, ...]:
    """What must not depend on who downloaded: snapshot id and every file's identity."""
    return (
        result.repo,
        result.revision,
        result.commit,
        result.snapshot_path.name,
        [(f.path, f.size, f.sha256, f.verified) for f in result.files],
    )


class Recorder:
    """A ProgressSink that keeps what it was told."""

    def __init__(self) -> None:
        self.added: dict[str, int | None] = {}
        self.advanced: dict[str, int] = {}
        self.done: list[FileOutcome] = []

    def add_file(self, path: str, size: int | None) -> None:
        assert path not in self.added, f"{path} added twice"
        self.added[path] = size

    def advance(self, path: str, nbytes: int) -> None:
        assert path in self.added, f"progress for {path} before add_file"
        self.advanced[path] = self.advanced.get(path, 0) + nbytes

    def file_done(self, outcome: FileOutcome) -> None:
        self.done.append(outcome)


def header_size(checkpoint: Checkpoint, shard: str) -> int:
    return int.from_bytes(checkpoint.path(shard).read_bytes()[:8], "little")


async def test_without_a_daemon_the_same_calls_run_in_process(
    hub: FakeHub, checkpoint: Checkpoint, workdir: Path, daemon: Daemon
) -> None:
    config = fast_config(workdir / "own-cache", hub.endpoint)
    async with Client(config, socket=_no_daemon(workdir)) as alone:
        assert alone.mode == "in-process"
        prepared_here = await alone.prepare(REPO)
        job = await alone.prefetch(REPO)
        shards = [shard async for shard in job.shards()]
        local = await job.wait()
        status = await alone.status()
    assert [(s.index, s.path, s.count) for s in shards] == [
        (i, name, len(checkpoint.shards)) for i, name in enumerate(checkpoint.shards)
    ]
    assert status["mode"] == "in-process" and status["jobs"]["done"] == 1
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        assert client.mode == "daemon"
        prepared_there = await client.prepare(REPO)
        remote = await (await client.prefetch(REPO)).wait()
    assert prepared_here is not None and prepared_here == prepared_there
    assert dict(prepared_here.headers) == {
        shard: checkpoint.path(shard).read_bytes()[8 : 8 + header_size(checkpoint, shard)]
        for shard in checkpoint.shards
    }
    plain = await prefetch(REPO, fast_config(workdir / "plain-cache", hub.endpoint))
    assert _identity(local) == _identity(remote) == _identity(plain)
    assert local.snapshot_path.is_relative_to(workdir / "own-cache")
    assert remote.snapshot_path.is_relative_to(workdir / "daemon-cache")
    assert_snapshot_matches(local.snapshot_path, checkpoint)
    assert_snapshot_matches(remote.snapshot_path, checkpoint)


async def test_fallback_error_refuses_to_run_in_process(workdir: Path) -> None:
    client = Client(fast_config(workdir / "cache"), socket=_no_daemon(workdir), fallback="error")
    with pytest.raises(errors.DaemonUnavailableError, match="no shardsync daemon answers"):
        await client.connect()
    forced = Client(fast_config(workdir / "cache"), socket=_no_daemon(workdir), use_daemon=False)
    async with forced:
        assert forced.mode == "in-process"


async def test_shards_come_in_index_order_even_when_they_finish_out_of_order(
    hub: FakeHub, checkpoint: Checkpoint, daemon: Daemon
) -> None:
    slow = checkpoint.shards[0]
    hub.faults.add(Bandwidth(150_000, times=None, path=slow))
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        job = await client.prefetch(REPO)
        yielded = [shard.path async for shard in job.shards()]
        verified = [
            e.outcome.path
            async for e in job.events()
            if isinstance(e, Verified) and e.shard_index is not None
        ]
    assert verified[-1] == slow  # the first shard was verified last ...
    assert yielded == list(checkpoint.shards)  # ... and still handed out first


async def test_progress_replays_as_the_engine_reports_it(
    hub: FakeHub, checkpoint: Checkpoint, daemon: Daemon, workdir: Path
) -> None:
    remote = Recorder()
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        result = await (await client.prefetch(REPO)).wait(remote)
    local = Recorder()
    await prefetch(REPO, fast_config(workdir / "plain", hub.endpoint), progress=local)
    assert remote.added == local.added
    assert remote.advanced == {f.path: f.size for f in result.files}
    assert sorted(o.path for o in remote.done) == sorted(o.path for o in local.done)
    assert next(iter(remote.added)) == "model.safetensors.index.json"


async def test_wait_file_returns_a_readable_path(
    hub: FakeHub, checkpoint: Checkpoint, daemon: Daemon
) -> None:
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        path = await client.wait_file(REPO, "config.json")
        assert _read(path) == _read(checkpoint.path("config.json"))
        shard = checkpoint.shards[-1]
        assert _read(await client.wait_file(REPO, shard)) == _read(checkpoint.path(shard))
        with pytest.raises(errors.EntryNotFoundError, match=r"nope\.bin"):
            await client.wait_file(REPO, "nope.bin")
        with pytest.raises(errors.RepoNotFoundError):
            await client.wait_file("acme/missing", "config.json")


async def test_jobs_listing_and_handles_by_id(daemon: Daemon) -> None:
    async with Client(socket=daemon.socket_path, fallback="error") as client:
        job = await client.prefetch(REPO, priority=3)
        assert job.created
        joined = await client.prefetch(REPO)
        assert joined.id == job.id and not joined.created
        await job.wait()
        again = await client.job(job.id)
        assert again.info["state"] == "done" and again.info["priority"] == 3
        assert [j["id"] for j in await client.jobs()] == [job.id]
        assert (await client.cache())["blobs"] > 0
        with pytest.raises(errors.DaemonError, match="no job"):
            await client.job("0" * 16)


async def test_without_a_tier_a_job_has_no_tier_counters_to_wait_for(
    hub: FakeHub, daemon: Daemon, workdir: Path
) -> None:
    """Through the daemon and in-process alike: ``tier`` is null and final once the job is
    done, so ``wait_tier`` answers at once."""
    own = fast_config(workdir / "own-cache", hub.endpoint)
    for client in (
        Client(socket=daemon.socket_path, fallback="error"),
        Client(own, socket=_no_daemon(workdir)),
    ):
        async with client:
            job = await client.prefetch(REPO)
            result = await job.wait()
            assert result.tier is None
            assert await asyncio.wait_for(job.wait_tier(), 10) is None
            info = await job.refresh()
            assert info["tier"] is None and info["tier_final"], client.mode
            assert (await client.status())["tier"] is None


async def test_sync_client_in_process(hub: FakeHub, checkpoint: Checkpoint, workdir: Path) -> None:
    config = fast_config(workdir / "cache", hub.endpoint)

    def use() -> PrefetchResult:  # in a thread: the fake hub serves from this loop
        with shardsync.SyncClient(config, socket=_no_daemon(workdir)) as client:
            assert client.mode == "in-process"
            job = client.prefetch(REPO)
            assert [s.path for s in job.shards()] == list(checkpoint.shards)
            result = job.wait()
            assert isinstance(list(job.events())[-1], JobDone)
            assert client.status()["jobs"]["done"] == 1
        with pytest.raises(errors.DaemonUnavailableError):
            SyncClient(config, socket=_no_daemon(workdir), fallback="error")
        return result

    result = await asyncio.to_thread(use)
    assert_snapshot_matches(result.snapshot_path, checkpoint)


async def test_sync_client_through_the_daemon(checkpoint: Checkpoint, daemon: Daemon) -> None:
    def use() -> tuple[list[str], Path, Prepared | None]:
        with SyncClient(socket=daemon.socket_path, fallback="error") as client:
            prepared = client.prepare(REPO)
            job = client.prefetch(REPO)
            shards = [s.path for s in job.shards()]
            return shards, client.wait_file(REPO, "config.json"), prepared

    shards, config_json, prepared = await asyncio.to_thread(use)  # the daemon needs this loop
    assert shards == list(checkpoint.shards)
    assert prepared is not None
    assert [e.path for e in prepared.manifest.shards] == list(checkpoint.shards)
    assert dict(prepared.headers) == {
        shard: checkpoint.path(shard).read_bytes()[8 : 8 + header_size(checkpoint, shard)]
        for shard in checkpoint.shards
    }
    assert config_json.name == "config.json"


def test_client_is_exported_lazily() -> None:
    assert shardsync.Client is Client and shardsync.SyncClient is SyncClient


def _read(path: Path) -> bytes:
    return path.read_bytes()
