"""shardsync.Client and SyncClient: through a daemon, and in-process when none answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path

import pytest
from daemons import daemon_in_loop, short_tmp
from helpers import assert_snapshot_matches, fast_config

import shardsync
from shardsync import daemon_transport, errors
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
            status = client.status()
            assert status["jobs"]["done"] == 1
            counted = ("jobs_submitted", "jobs_deduplicated", "files_waiting")
            assert [status[k] for k in counted] == [1, 0, 0]  # as a daemon's status counts
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


# ------------------------------------------------------------------ daemons that misbehave

Stream = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))
    await writer.drain()


def _event(kind: str, seq: int, **fields: object) -> bytes:
    return json.dumps({"event": kind, "job": "j1", "time": 1.0, **fields, "seq": seq}).encode()


@contextlib.asynccontextmanager
async def _fake_daemon(
    workdir: Path, answers: Mapping[str, object] = {}, stream: Stream | None = None
) -> AsyncIterator[Path]:
    """A socket speaking the daemon's HTTP with the answers given ("METHOD /path": JSON
    body, 200) and ``stream`` writing a job's event lines: what a daemon that froze, or
    a hostile one, does."""
    defaults = {"GET /v1/status": {"cache_dir": "x", "api": 1}, "POST /v1/jobs": {"id": "j1"}}
    answers = {**defaults, **answers}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target, _ = head.split(b"\r\n")[0].decode().split(" ")
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                await reader.readexactly(int(line.split(b":")[1]))
        try:
            if "/events" in target and stream is not None:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                await stream(reader, writer)
                await _chunk(writer, b"")
            else:
                answer = answers.get(f"{method} {target.split('?')[0]}", {})
                body = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                writer.write(body)
            await writer.drain()
        except ConnectionError:
            pass  # the client went away
        finally:
            writer.close()

    path = workdir / "fake.sock"
    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield path
    finally:
        server.close()


async def test_a_daemon_of_another_api_version_is_not_used(workdir: Path) -> None:
    """A daemon answering ``"api": 2`` took jobs in version 1's shapes and failed them
    late, with a ``KeyError`` of its result; it is passed over as no daemon at all."""
    status = {"GET /v1/status": {"cache_dir": "x", "api": 2}}
    async with _fake_daemon(workdir, status) as path:
        with pytest.raises(errors.DaemonUnavailableError):
            async with Client(socket=path, fallback="error"):
                pass


async def test_a_daemon_that_freezes_mid_stream_is_lost_not_waited_for(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon sends a heartbeat line on a silent stream: a stream silent for several
    of them is a daemon gone (SIGSTOP, a stuck loop), and the wait says so."""
    monkeypatch.setattr(daemon_transport, "_STREAM_IDLE_S", 0.5)

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _chunk(writer, b"\n")
        await asyncio.sleep(3600)

    async with (
        _fake_daemon(workdir, stream=frozen) as path,
        Client(socket=path, fallback="error") as client,
    ):
        job = await client.prefetch(REPO)
        with pytest.raises(errors.DaemonError):
            await asyncio.wait_for(job.wait(), 10)


async def test_heartbeats_keep_a_slow_stream_alive(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline is for each read, not for the whole stream."""
    monkeypatch.setattr(daemon_transport, "_STREAM_IDLE_S", 0.5)

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(8):
            await asyncio.sleep(0.2)
            await _chunk(writer, b"\n")
        await _chunk(writer, _event("job_done", 0, result={}) + b"\n")

    async with (
        _fake_daemon(workdir, stream=slow) as path,
        Client(socket=path, fallback="error") as client,
    ):
        job = await client.prefetch(REPO)
        events = [event async for event in job.events()]
    assert [type(e) for e in events] == [JobDone]


async def test_a_socket_path_too_long_for_af_unix_is_no_daemon(workdir: Path) -> None:
    """A long $XDG_RUNTIME_DIR names a socket no daemon can listen on: not there, so the
    client falls back (or says no daemon answers), as for a missing one."""
    socket = workdir / ("r" * 120) / "d.sock"
    async with Client(fast_config(workdir / "cache"), socket=socket) as client:
        assert client.mode == "in-process"
    with pytest.raises(errors.DaemonUnavailableError):
        await Client(fast_config(workdir / "cache"), socket=socket, fallback="error").connect()


async def test_a_socket_other_users_could_have_planted_is_not_used(
    daemon: Daemon, workdir: Path
) -> None:
    """Anyone may create ``/tmp/shardsync-$UID/`` first and listen there: a client that
    used such a socket would take another user's answers (the files to load, their
    headers) for its daemon's. A socket in a directory other users may write, or in a
    directory of someone else's inside a shared one, is skipped like a missing one."""
    socket_path = workdir / "shardsync" / "d.sock"
    async with Client(socket=socket_path, fallback="error") as client:
        assert client.mode == "daemon"  # the daemon's own private directory: trusted
    os.chmod(socket_path.parent, 0o777)  # the same daemon, its directory opened to all
    try:
        with pytest.raises(errors.DaemonUnavailableError):
            await Client(socket=socket_path, fallback="error").connect()
    finally:
        os.chmod(socket_path.parent, 0o700)
    shared = workdir / "tmp"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)  # what /tmp is
    planted = shared / f"shardsync-{os.getuid()}" / "shardsync.sock"
    planted.parent.mkdir(mode=0o700)
    assert daemon_transport.socket_doubt(planted) is None  # our own directory there
    if os.geteuid() == 0:
        os.chown(planted.parent, 65534, 65534)  # another user's, in the shared directory
        assert daemon_transport.socket_doubt(planted) is not None
    else:  # the directory is ours: seen by someone else, it is another user's
        assert daemon_transport.socket_doubt(planted, euid=os.geteuid() + 1) is not None


@contextlib.contextmanager
def _fake_daemon_in_thread(workdir: Path, stream: Stream) -> Iterator[Path]:
    """``_fake_daemon`` on a loop of its own, for a test whose main thread blocks."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    serving = _fake_daemon(workdir, stream=stream)

    async def stop() -> None:
        await serving.__aexit__(None, None, None)
        handlers = asyncio.all_tasks() - {asyncio.current_task()}
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    try:
        yield asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result()
        asyncio.run_coroutine_threadsafe(stop(), loop).result()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


class _Endless:
    """An event stream that sends nothing until its client goes away."""

    def __init__(self) -> None:
        self.opened, self.ended = threading.Event(), threading.Event()

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened.set()
        try:
            await reader.read()
        finally:
            self.ended.set()


def test_ctrl_c_while_a_sync_client_iterates_is_a_keyboard_interrupt(workdir: Path) -> None:
    """Ctrl-C stops the iteration as Ctrl-C, and the stream it waited on is closed. The
    signal goes only while the loop still runs, and the test waits for its sender: a SIGINT
    landing once the loop had ended another way (a failure, then) hit pytest as it wrote
    the report (once, in a CI run with two workers: an internal error, no report at all)."""
    stream = _Endless()
    iterating = threading.Event()

    def interrupt() -> None:
        if stream.opened.wait(10) and iterating.is_set():
            os.kill(os.getpid(), signal.SIGINT)

    with _fake_daemon_in_thread(workdir, stream) as path:
        client = SyncClient(socket=path, fallback="error")
        job = client.prefetch(REPO)
        sender = threading.Thread(target=interrupt, daemon=True)
        raised: BaseException | None = None
        try:
            try:
                iterating.set()
                sender.start()
                for _ in job.events():
                    pass
            except BaseException as exc:  # whatever it is, reported below, not by a crash
                raised = exc
            finally:
                iterating.clear()
                sender.join(15)
        except KeyboardInterrupt:
            pass  # sent as the loop ended another way: ``raised`` says how it ended
        assert type(raised) is KeyboardInterrupt, repr(raised)
        assert stream.ended.wait(5)
        client.close()


def test_closing_a_sync_client_ends_the_calls_other_threads_wait_in(workdir: Path) -> None:
    stream = _Endless()
    raised: list[BaseException] = []

    def follow(job: shardsync.SyncJobHandle) -> None:
        try:
            list(job.events())
        except BaseException as exc:
            raised.append(exc)

    with _fake_daemon_in_thread(workdir, stream) as path:
        client = SyncClient(socket=path, fallback="error")
        follower = threading.Thread(target=follow, args=(client.prefetch(REPO),), daemon=True)
        follower.start()
        assert stream.opened.wait(10)
        client.close()
        follower.join(10)
        assert not follower.is_alive()
        assert stream.ended.wait(5)
    assert [type(exc) for exc in raised] == [errors.DaemonStoppingError]


_WRONG_SHAPES = {
    "status is a list": ({"GET /v1/status": [1]}, lambda c: c.status()),
    "jobs without a list": ({"GET /v1/jobs": {"x": 1}}, lambda c: c.jobs()),
    "jobs of strings": ({"GET /v1/jobs": {"jobs": ["a"]}}, lambda c: c.jobs()),
    "a job that is a list": ({"POST /v1/jobs": [1, 2]}, lambda c: c.prefetch(REPO)),
    "a job without an id": ({"POST /v1/jobs": {}}, lambda c: c.prefetch(REPO)),
    "a job whose id is a number": ({"POST /v1/jobs": {"id": 7}}, lambda c: c.prefetch(REPO)),
    "a job that is a string": ({"GET /v1/jobs/abc": "hello"}, lambda c: c.job("abc")),
    "a cancel answering null": (
        {"GET /v1/jobs/j1": {"id": "j1"}, "DELETE /v1/jobs/j1": None},
        lambda c: _cancel(c, "j1"),
    ),
    "a cache that is a number": ({"GET /v1/cache": 5}, lambda c: c.cache()),
    "JSON nested too deep to read": ({"GET /v1/cache": b"[" * 200_000}, lambda c: c.cache()),
}


async def _cancel(client: Client, job_id: str) -> None:
    await (await client.job(job_id)).cancel()


@pytest.mark.parametrize(("answers", "call"), _WRONG_SHAPES.values(), ids=_WRONG_SHAPES)
async def test_well_formed_answers_of_the_wrong_shape_are_daemon_errors(
    workdir: Path,
    answers: Mapping[str, object],
    call: Callable[[Client], Awaitable[object]],
) -> None:
    async with _fake_daemon(workdir, answers) as path:
        with pytest.raises(errors.DaemonError):
            async with Client(socket=path, fallback="error") as client:
                await call(client)


def _verified(seq: int, index: int) -> bytes:
    name = f"s{index}.safetensors"
    fields = {"path": name, "size": 1, "sha256": "0" * 64, "verified": "sha256"}
    fields |= {"source": "network", "downloaded": 1, "resumed": 0, "shard_index": index}
    return _event("verified", seq, **fields, file=f"/x/{name}", blob=f"/x/b{index}")


@pytest.mark.parametrize("indices", [[0, 2], [0, 1, 2, 3], [0, 0, 1, 2], [0, 1, -1, 2]], ids=str)
async def test_shards_of_a_stream_that_skips_repeats_or_invents_one_are_a_daemon_error(
    workdir: Path, indices: list[int]
) -> None:
    """Three shards resolved: ``shards()`` hands out each once or raises, never ends quietly
    with one missing."""
    files = [
        {"path": f"s{i}.safetensors", "size": 1, "role": "shard", "shard_index": i}
        for i in range(3)
    ]
    resolved = {"commit": "a" * 40, "revision": "main", "total_size": 3, "files": files}

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lines = [_event("resolved", 0, **resolved)]
        lines += [_verified(seq, i) for seq, i in enumerate(indices, 1)]
        lines.append(_event("job_done", len(lines), result={}))
        await _chunk(writer, b"".join(line + b"\n" for line in lines))

    async with (
        _fake_daemon(workdir, stream=stream) as path,
        Client(socket=path, fallback="error") as client,
    ):
        job = await client.prefetch(REPO)
        handed: list[int] = []
        with pytest.raises(errors.DaemonError):
            async for shard in job.shards():
                handed.append(shard.index)
    assert handed == sorted(set(handed)) and set(handed) <= {0, 1, 2}
