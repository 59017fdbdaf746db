"""``shardsync.Client``: ask the daemon for models, or run the engine in-process without one.

::

    async with shardsync.Client() as client:
        job = await client.prefetch("org/model", priority=10)
        async for shard in job.shards():       # each verified shard, in index order
            load(shard.file)
        result = await job.wait()              # a PrefetchResult, like shardsync.prefetch's
        tier = await job.wait_tier()           # its final shared-tier counters (or None)
        config = await client.wait_file("org/model", "config.json")

The same calls work whether a daemon answers or not: without one (and with the default
``fallback = "in-process"``) the client runs the same scheduler on its own engine, so jobs,
events and results are identical; only the dedup across processes is then left to the
cache's per-blob locks. A ``JobHandle`` is this side's view of the scheduler's ``SharedJob``;
its events are the typed ones of ``shardsync.events`` either way (over the daemon, each
NDJSON line is parsed; a kind this version does not know is skipped). Errors are the
project's own exceptions carrying the daemon's message. ``SyncClient`` offers the same API
to code without an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from shardsync.api import JobRequest, result_from_json
from shardsync.checkpoint import selection_for
from shardsync.config import Config, Fallback, client_sockets, load_config
from shardsync.daemon_transport import DaemonTransport, error_from
from shardsync.errors import DaemonError, DaemonUnavailableError, EntryNotFoundError
from shardsync.events import (
    FileStarted,
    JobDone,
    JobEvent,
    JobFailed,
    Progress,
    Resolved,
    Verified,
)
from shardsync.prefetch import Engine
from shardsync.records import PrefetchResult, ProgressSink, TierStatistics
from shardsync.scheduler import Scheduler, SharedJob

if TYPE_CHECKING:
    from shardsync.checkpoint import CheckpointResult

__all__ = ["Client", "JobHandle", "Shard", "SyncClient", "SyncJobHandle", "daemon_for"]

_T = TypeVar("_T")
_POLL_FIRST, _POLL_MAX = 0.05, 1.0  # seconds between looks at a job's uploads to the tier

Mode = Literal["daemon", "in-process"]


@dataclass(frozen=True, slots=True)
class Shard:
    """A verified weights file, handed out in index order."""

    path: str  # the file's name in the repository
    index: int  # its position among the checkpoint's shards (0-based, index order)
    count: int  # how many shards the checkpoint has
    file: Path  # where to read it (the snapshot entry, or the blob for URL/local origins)
    size: int
    sha256: str

    @classmethod
    def from_event(cls, event: Verified, index: int, count: int) -> Shard:
        o = event.outcome
        return cls(
            path=o.path, index=index, count=count, file=event.file, size=o.size, sha256=o.sha256
        )


async def daemon_for(
    config: Config, *, cache_dir: str | os.PathLike[str] | None, endpoint: str | None
) -> Client | None:
    """A connected client of the daemon when one answers and serves what the caller named;
    None: do the work in this process. The one place that decides, for ``shardsync
    prefetch``, ``shardsync load`` and ``shardsync.load`` alike; the caller closes the client.

    ``cache_dir`` and ``endpoint`` are what the caller named explicitly (``--cache-dir``,
    ``cache_dir=``, ``$SHARDSYNC_CACHE_DIR``; ``--endpoint``, ``endpoint=``), None when they
    named none: a cache or Hub other than the daemon's is not the daemon's to serve. No daemon
    answering raises ``DaemonUnavailableError`` where ``config.daemon.fallback`` is "error".
    """
    client = Client(config, fallback="error")
    try:
        await client.connect()
    except DaemonUnavailableError:
        if config.daemon.fallback == "error":
            raise
        return None
    if not _serves(client.daemon_status or {}, cache_dir=cache_dir, endpoint=endpoint):
        await client.close()
        return None
    return client


def _serves(
    status: Mapping[str, Any], *, cache_dir: str | os.PathLike[str] | None, endpoint: str | None
) -> bool:
    """Whether a daemon (its ``GET /v1/status``) serves the cache and Hub a caller named."""
    if cache_dir is not None and status.get("cache_dir") != os.path.abspath(cache_dir):
        return False
    wanted = (endpoint or "").rstrip("/")
    return not wanted or wanted == (status.get("endpoint") or "").rstrip("/")


class _Transport(Protocol):
    """How a job reaches its scheduler: the daemon's API, or one in this process."""

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]: ...

    async def info(self, job_id: str) -> Mapping[str, Any]: ...

    async def cancel(self, job_id: str) -> Mapping[str, Any]: ...

    def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]: ...


class JobHandle:
    """A handle on a job, however many clients share it; cheap to create again by id."""

    def __init__(self, transport: _Transport, info: Mapping[str, Any], *, created: bool) -> None:
        self._transport = transport
        self.id: str = str(info["id"])
        self.info: Mapping[str, Any] = info
        """The job as it was when this handle was made (``refresh()`` for a new one)."""
        self.created = created
        """Whether this request started the job (False: it joined one already running)."""

    def __repr__(self) -> str:
        return (
            f"<shardsync.JobHandle {self.id} {self.info.get('repo')}@{self.info.get('revision')}>"
        )

    async def refresh(self) -> Mapping[str, Any]:
        self.info = await self._transport.info(self.id)
        return self.info

    async def cancel(self) -> None:
        """Cancel the job for every client; partial files stay for a later run."""
        self.info = await self._transport.cancel(self.id)

    async def events(self, since: int = 0) -> AsyncIterator[JobEvent]:
        """The job's events from ``since``: past ones first, then live, ending with
        ``JobDone`` or ``JobFailed``."""
        async for event in self._transport.events(self.id, since):
            yield event

    async def wait(self, progress: ProgressSink | None = None) -> PrefetchResult:
        """The complete snapshot; raises the job's error. ``progress`` gets the engine's
        progress calls, rebuilt from the events (the CLI draws its bars with it). Its
        ``tier`` is None: the uploads the job owes the fleet may still run (``wait_tier``)."""
        return result_from_json(await self._wait_done(progress))

    async def wait_tier(self) -> TierStatistics | None:
        """The job's own tier counters once final (None without a tier): after it finished
        and the uploads it owes the fleet ended or were given up. The job's record says so
        (``tier_final``), and no event does (the job's events end with the snapshot), so
        this looks again at a growing interval, up to a second."""
        delay = _POLL_FIRST
        info = await self.refresh()
        while not info.get("tier_final", True):  # a daemon without the field has no tier
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)
            info = await self.refresh()
        try:
            return None if info.get("tier") is None else TierStatistics.from_json(info["tier"])
        except ValueError as exc:
            raise DaemonError(f"malformed tier counters from the daemon: {exc}") from exc

    async def wait_checkpoint(self, progress: ProgressSink | None = None) -> CheckpointResult:
        """A training checkpoint job's outcome: which checkpoint, its local folder."""
        from shardsync.checkpoint import checkpoint_result_from_json

        return checkpoint_result_from_json(await self._wait_done(progress))

    async def _wait_done(self, progress: ProgressSink | None) -> Mapping[str, Any]:
        """The ``JobDone`` result object; raises the job's error."""
        driver = _ProgressDriver(progress) if progress is not None else None
        async for event in self.events():
            if driver is not None:
                driver.feed(event)
            if isinstance(event, JobDone):
                return event.result
            _raise_failure(event)
        raise DaemonError(f"the event stream of job {self.id} ended without an outcome")

    async def shards(self) -> AsyncIterator[Shard]:
        """Each shard once verified, strictly in index order; raises the job's error."""
        ready: dict[int, Shard] = {}
        count = 0
        following = 0
        async for event in self.events():
            if isinstance(event, Resolved):
                count = event.shard_count
            elif isinstance(event, Verified) and event.shard_index is not None:
                ready[event.shard_index] = Shard.from_event(event, event.shard_index, count)
            while following in ready:
                yield ready.pop(following)
                following += 1
            if isinstance(event, JobDone):
                return
            _raise_failure(event)


def _raise_failure(event: JobEvent) -> None:
    """Raise the job's error if ``event`` says it failed."""
    if isinstance(event, JobFailed):
        raise error_from(event.error)


class _ProgressDriver:
    """Replays events as ``ProgressSink`` calls in the order the engine makes them."""

    def __init__(self, sink: ProgressSink) -> None:
        self._sink = sink
        self._done: dict[str, int] = {}

    def _add(self, path: str, size: int | None) -> None:
        if path not in self._done:
            self._done[path] = 0
            self._sink.add_file(path, size)

    def _advance(self, path: str, size: int | None, done: int) -> None:
        self._add(path, size)
        if done != self._done[path]:
            self._sink.advance(path, done - self._done[path])
            self._done[path] = done

    def feed(self, event: JobEvent) -> None:
        match event:
            case Resolved():
                for f in event.files:
                    self._add(f.path, f.size)
            case FileStarted():
                self._add(event.path, event.size)
            case Progress():
                self._advance(event.path, event.size, event.done)
            case Verified(outcome=outcome):
                self._advance(outcome.path, outcome.size, outcome.size)
                self._sink.file_done(outcome)


# ---------------------------------------------------------------------------------- transports


class _LocalTransport:
    """A scheduler in this process: what the client runs when no daemon answers."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _job(self, job_id: str) -> SharedJob:
        job = self.scheduler.get(job_id)
        if job is None:
            raise DaemonError(f"no job {job_id!r}")
        return job

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]:
        job, created = await self.scheduler.submit(request)
        return job.info(), created

    async def info(self, job_id: str) -> Mapping[str, Any]:
        return self._job(job_id).info()

    async def cancel(self, job_id: str) -> Mapping[str, Any]:
        await self.scheduler.cancel(job_id)
        return self._job(job_id).info()

    async def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]:
        async for event in self._job(job_id).events.follow(since):
            yield event


# ---------------------------------------------------------------------------------- the client


class Client:
    """Talks to the daemon, or runs the engine in-process when none answers.

    ``config`` defaults to ``load_config(None, environ)``; ``socket`` to the configured or
    default daemon sockets; ``fallback`` to ``config.daemon.fallback``. ``use_daemon=False``
    always runs in-process (what ``--no-daemon`` does).
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        socket: str | Path | None = None,
        fallback: Fallback | None = None,
        use_daemon: bool = True,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._environ = os.environ if environ is None else environ
        self.config = config or load_config(None, self._environ)
        if socket is not None:
            self.config = replace(
                self.config, daemon=replace(self.config.daemon, socket=Path(socket))
            )
        self._fallback = fallback or self.config.daemon.fallback
        self._use_daemon = use_daemon
        self._stack: contextlib.AsyncExitStack | None = None
        self._transport: DaemonTransport | _LocalTransport | None = None
        self.daemon_status: Mapping[str, Any] | None = None
        """The daemon's ``/v1/status`` when connecting (None in-process)."""

    @property
    def mode(self) -> Mode:
        if self._transport is None:
            raise RuntimeError("connect first: 'async with Client() as client'")
        return "daemon" if isinstance(self._transport, DaemonTransport) else "in-process"

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Find a daemon that answers; else fall back (or raise ``DaemonUnavailableError``)."""
        if self._stack is not None:
            return
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            self._transport = await self._open(stack)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def _open(self, stack: contextlib.AsyncExitStack) -> DaemonTransport | _LocalTransport:
        tried: list[str] = []
        if self._use_daemon:
            for path in client_sockets(self.config.daemon, self._environ):
                transport = DaemonTransport(path)
                try:
                    self.daemon_status = (await transport.request("GET", "/v1/status"))[1]
                except DaemonUnavailableError as exc:
                    await transport.close()
                    tried.append(str(exc))
                    continue
                except BaseException:
                    await transport.close()
                    raise
                stack.push_async_callback(transport.close)
                return transport
            if self._fallback == "error":
                raise DaemonUnavailableError(
                    "no shardsync daemon answers (" + "; ".join(tried) + ")"
                )
        engine = await stack.enter_async_context(Engine(self.config, environ=self._environ))
        scheduler = await stack.enter_async_context(
            Scheduler(engine, selections=selection_for, history=self.config.daemon.history)
        )
        return _LocalTransport(scheduler)

    async def close(self) -> None:
        """Disconnect; in-process, this stops the jobs still running (partials are kept)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @property
    def _connection(self) -> DaemonTransport | _LocalTransport:
        """The transport, once connected."""
        if self._transport is None or self._stack is None:
            raise RuntimeError("connect first: 'async with Client() as client'")
        return self._transport

    async def prefetch(
        self,
        source: str,
        *,
        revision: str | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        priority: int = 0,
        allow_pickle: bool = False,
        checkpoint: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> JobHandle:
        """Start (or join) the job making ``source`` complete in the cache; with
        ``checkpoint`` (``"latest"`` or a folder name) a training checkpoint of the run at
        ``source``, or rank ``rank``'s files of it (``JobHandle.wait_checkpoint``)."""
        request = JobRequest(
            source=source,
            revision=revision,
            include=None if include is None else tuple(include),
            exclude=tuple(exclude),
            priority=priority,
            allow_pickle=allow_pickle,
            checkpoint=checkpoint,
            rank=rank,
            world_size=world_size,
        )
        info, created = await self._connection.submit(request)
        return JobHandle(self._connection, info, created=created)

    async def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (after a restart, the daemon keeps unfinished ids)."""
        return JobHandle(self._connection, await self._connection.info(job_id), created=False)

    async def jobs(self) -> list[Mapping[str, Any]]:
        if isinstance(self._connection, _LocalTransport):
            return [job.info() for job in self._connection.scheduler.jobs()]
        return list((await self._connection.request("GET", "/v1/jobs"))[1]["jobs"])

    async def wait_file(
        self,
        source: str,
        filename: str,
        *,
        revision: str | None = None,
        include: Sequence[str] | None = None,
    ) -> Path:
        """Where ``filename`` of ``source`` can be read, as soon as it is verified.

        It joins (or starts) the job for ``source`` with ``include``; a file that job does
        not fetch raises ``EntryNotFoundError``.
        """
        job = await self.prefetch(source, revision=revision, include=include)
        async for event in job.events():
            if isinstance(event, Verified) and event.outcome.path == filename:
                return event.file
            if isinstance(event, Resolved) and filename not in {f.path for f in event.files}:
                break
            if isinstance(event, JobDone):
                break
            _raise_failure(event)
        raise EntryNotFoundError(
            f"{filename} is not among the files prefetched from {source}"
            f"@{job.info.get('revision')} (weights, and small files matching include)"
        )

    async def status(self) -> dict[str, Any]:
        """The daemon's statistics (``GET /v1/status``), or this process's scheduler's."""
        if isinstance(self._connection, _LocalTransport):
            scheduler = self._connection.scheduler
            fetch = scheduler.engine.fetcher.statistics()
            stats = scheduler.statistics()
            tier = scheduler.engine.tier
            return {
                "mode": "in-process",
                "cache_dir": str(self.config.cache_dir),
                "endpoint": self.config.endpoint,
                "jobs": dict(stats.jobs),
                "bytes_downloaded": fetch.bytes_downloaded,
                "files_fetched": fetch.files_fetched,
                "active_connections": fetch.active_connections,
                "retries": dict(fetch.retries),
                "verify_failures": fetch.verify_failures,
                "tier": None if tier is None else asdict(tier.statistics()),
            }
        return {"mode": "daemon", **(await self._connection.request("GET", "/v1/status"))[1]}

    async def cache(self) -> dict[str, Any]:
        """The daemon's cache summary (``GET /v1/cache``); in-process, this cache's."""
        if isinstance(self._connection, _LocalTransport):
            from shardsync.inventory import cache_summary

            return await asyncio.to_thread(cache_summary, self.config.cache_dir)
        return dict((await self._connection.request("GET", "/v1/cache"))[1])


# ---------------------------------------------------------------------------------- sync


class SyncClient:
    """``Client`` for code without an event loop: one runs in a background thread.

    ::

        with shardsync.SyncClient() as client:
            job = client.prefetch("org/model")
            for shard in job.shards():
                consume(shard.file)
            print(job.wait().snapshot_path)
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        socket: str | Path | None = None,
        fallback: Fallback | None = None,
        use_daemon: bool = True,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._client = Client(
            config, socket=socket, fallback=fallback, use_daemon=use_daemon, environ=environ
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="shardsync-client", daemon=True
        )
        self._thread.start()
        self._closing = asyncio.Event()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._host = asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        try:
            ready.result()
        except BaseException:
            self._shutdown()
            raise

    async def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        """The one task that enters and leaves the client (its task group needs that)."""
        try:
            async with self._client:
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
                return
            raise

    def _call(self, awaitable: Awaitable[_T]) -> _T:
        async def run() -> _T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def _iterate(self, iterator: AsyncIterator[_T]) -> Iterator[_T]:
        try:
            while True:
                try:
                    yield self._call(iterator.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                self._call(aclose())

    @property
    def mode(self) -> Mode:
        return self._client.mode

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._closing.set)
        with contextlib.suppress(Exception):
            self._host.result()
        self._shutdown()

    def _shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def prefetch(
        self,
        source: str,
        *,
        revision: str | None = None,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] = (),
        priority: int = 0,
        allow_pickle: bool = False,
    ) -> SyncJobHandle:
        job = self._call(
            self._client.prefetch(
                source,
                revision=revision,
                include=include,
                exclude=exclude,
                priority=priority,
                allow_pickle=allow_pickle,
            )
        )
        return SyncJobHandle(self, job)

    def job(self, job_id: str) -> SyncJobHandle:
        return SyncJobHandle(self, self._call(self._client.job(job_id)))

    def jobs(self) -> list[Mapping[str, Any]]:
        return self._call(self._client.jobs())

    def wait_file(
        self,
        source: str,
        filename: str,
        *,
        revision: str | None = None,
        include: Sequence[str] | None = None,
    ) -> Path:
        return self._call(
            self._client.wait_file(source, filename, revision=revision, include=include)
        )

    def status(self) -> dict[str, Any]:
        return self._call(self._client.status())

    def cache(self) -> dict[str, Any]:
        return self._call(self._client.cache())


class SyncJobHandle:
    """``JobHandle`` with blocking methods and plain iterators."""

    def __init__(self, client: SyncClient, job: JobHandle) -> None:
        self._client = client
        self.job = job

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def info(self) -> Mapping[str, Any]:
        return self.job.info

    def refresh(self) -> Mapping[str, Any]:
        return self._client._call(self.job.refresh())

    def cancel(self) -> None:
        self._client._call(self.job.cancel())

    def wait(self, progress: ProgressSink | None = None) -> PrefetchResult:
        return self._client._call(self.job.wait(progress))

    def wait_tier(self) -> TierStatistics | None:
        return self._client._call(self.job.wait_tier())

    def events(self, since: int = 0) -> Iterator[JobEvent]:
        return self._client._iterate(self.job.events(since))

    def shards(self) -> Iterator[Shard]:
        return self._client._iterate(self.job.shards())
