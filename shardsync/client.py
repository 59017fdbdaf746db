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
cache's per-blob locks. Jobs, their handles and the daemon's side are ``shardsync.jobs``'s;
this module adds the in-process side. Errors are the project's own exceptions carrying the
daemon's message. ``SyncClient`` offers the same API to code without an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Generic, TypeVar

from shardsync.api import CheckpointResult, JobRequest
from shardsync.checkpoint_selection import selection_for
from shardsync.config import Config, Fallback
from shardsync.errors import DaemonError, DaemonStoppingError
from shardsync.events import JobEvent
from shardsync.inventory import cache_summary
from shardsync.jobs import JobClient, JobHandle, Mode, Shard, Transport, daemon_for
from shardsync.prefetch import Engine
from shardsync.prepared import Prepared
from shardsync.prune import CacheRoom
from shardsync.records import PrefetchResult, ProgressSink, TierStatistics
from shardsync.scheduler import Scheduler, SharedJob

__all__ = ["Client", "JobHandle", "Shard", "SyncClient", "SyncJobHandle", "daemon_for"]

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------- transports


class LocalTransport:
    """A scheduler in this process: what the client runs when no daemon answers."""

    mode: Mode = "in-process"

    def __init__(self, scheduler: Scheduler, engine: Engine) -> None:
        self.scheduler, self.engine = scheduler, engine

    def _job(self, job_id: str) -> SharedJob:
        job = self.scheduler.get(job_id)
        if job is None:
            raise DaemonError(f"no job {job_id!r}")
        return job

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]:
        job, created = await self.scheduler.submit(request)
        return job.info(), created

    async def prepare(self, request: JobRequest) -> Prepared:
        origin = self.engine.origin(request.source)
        return await self.engine.prepare(
            origin, revision=request.revision, allow_pickle=request.allow_pickle
        )

    async def info(self, job_id: str) -> Mapping[str, Any]:
        return self._job(job_id).info()

    async def cancel(self, job_id: str) -> Mapping[str, Any]:
        await self.scheduler.cancel(job_id)
        return self._job(job_id).info()

    async def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]:
        async for event in self._job(job_id).events.follow(since):
            yield event

    async def jobs(self) -> list[Mapping[str, Any]]:
        return [job.info() for job in self.scheduler.jobs()]

    async def status(self) -> dict[str, Any]:
        scheduler = self.scheduler
        fetch = self.engine.fetcher.statistics()
        stats = scheduler.statistics()
        tier = self.engine.tier
        return {
            "cache_dir": str(self.engine.config.cache_dir),
            "endpoint": self.engine.config.endpoint,
            "jobs": dict(stats.jobs),
            "jobs_submitted": stats.jobs_submitted,
            "jobs_deduplicated": stats.jobs_deduplicated,
            "files_waiting": stats.files_waiting,
            "bytes_downloaded": fetch.bytes_downloaded,
            "files_fetched": fetch.files_fetched,
            "active_connections": fetch.active_connections,
            "retries": dict(fetch.retries),
            "verify_failures": fetch.verify_failures,
            "tier": None if tier is None else asdict(tier.statistics()),
        }

    async def cache(self) -> dict[str, Any]:
        return await asyncio.to_thread(cache_summary, self.engine.config.cache_dir)


# ---------------------------------------------------------------------------------- the client


class Client(JobClient):
    """Talks to the daemon, or runs the engine in-process when none answers.

    ``config`` defaults to ``load_config(None, environ)``; ``socket`` to the configured or
    default daemon sockets; ``fallback`` to ``config.daemon.fallback``. ``use_daemon=False``
    always runs in-process (what ``--no-daemon`` does).
    """

    async def _open_local(self, stack: contextlib.AsyncExitStack) -> Transport:
        engine = await stack.enter_async_context(Engine(self.config, environ=self._environ))
        scheduler = await stack.enter_async_context(
            Scheduler(
                engine,
                selections=selection_for,
                room=CacheRoom(engine.store, engine.config.prune),
                history=self.config.daemon.history,
            )
        )
        return LocalTransport(scheduler, engine)


# ---------------------------------------------------------------------------------- sync


class _Call(Generic[_T]):
    """An awaitable run on the client's loop for a blocking caller, who may give it up:
    ``outcome`` is done only once the task ended, cancelled or not."""

    def __init__(self, loop: asyncio.AbstractEventLoop, awaitable: Awaitable[_T]) -> None:
        self._loop = loop
        self._task: asyncio.Task[_T] | None = None
        self.outcome: concurrent.futures.Future[_T] = concurrent.futures.Future()
        loop.call_soon_threadsafe(self._start, awaitable)

    def _start(self, awaitable: Awaitable[_T]) -> None:
        async def run() -> _T:
            return await awaitable

        self._task = self._loop.create_task(run())
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[_T]) -> None:
        if task.cancelled():
            self.outcome.cancel()
            self.outcome.set_running_or_notify_cancel()  # wakes wait(), not only result()
        elif (exc := task.exception()) is not None:
            self.outcome.set_exception(exc)
        else:
            self.outcome.set_result(task.result())

    def cancel(self) -> None:
        """Cancel the task, from any thread (after ``_start``: the loop keeps their order)."""
        self._loop.call_soon_threadsafe(lambda: self._task is not None and self._task.cancel())


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
        self._lock = threading.Lock()
        self._calls: set[_Call[Any]] = set()
        self._closed = False
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
        """Run ``awaitable`` on the client's loop and wait for it. A wait given up (Ctrl-C)
        cancels it and waits for its end (its socket closed, a generator it ran free to
        close); ``close()`` in another thread ends it with ``DaemonStoppingError``."""
        with self._lock:
            if self._closed:
                getattr(awaitable, "close", lambda: None)()  # never to be awaited
                raise DaemonStoppingError("the client is closed")
            call = _Call(self._loop, awaitable)
            self._calls.add(call)
        try:
            return call.outcome.result()
        except concurrent.futures.CancelledError:
            if not self._closed:
                raise
            raise DaemonStoppingError("the client was closed while this call waited") from None
        except BaseException:
            if not call.outcome.done():  # interrupted while it runs
                call.cancel()
                concurrent.futures.wait([call.outcome])
            raise
        finally:
            with self._lock:
                self._calls.discard(call)

    def _iterate(self, iterator: AsyncIterator[_T]) -> Iterator[_T]:
        try:
            while True:
                try:
                    yield self._call(iterator.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None and not self._closed:
                with contextlib.suppress(DaemonStoppingError):  # closed meanwhile
                    self._call(aclose())

    @property
    def mode(self) -> Mode:
        return self._client.mode

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Disconnect; calls other threads wait in end with ``DaemonStoppingError``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        concurrent.futures.wait([call.outcome for call in calls])
        self._loop.call_soon_threadsafe(self._closing.set)
        with contextlib.suppress(Exception):
            self._host.result()
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
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
        checkpoint: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        in_order: bool = False,
    ) -> SyncJobHandle:
        """``Client.prefetch``, blocking; a training ``checkpoint``'s outcome comes from the
        handle's ``wait_checkpoint``."""
        job = self._call(
            self._client.prefetch(
                source,
                revision=revision,
                include=include,
                exclude=exclude,
                priority=priority,
                allow_pickle=allow_pickle,
                checkpoint=checkpoint,
                rank=rank,
                world_size=world_size,
                in_order=in_order,
            )
        )
        return SyncJobHandle(self, job)

    def prepare(
        self, source: str, *, revision: str | None = None, allow_pickle: bool = False
    ) -> Prepared | None:
        return self._call(
            self._client.prepare(source, revision=revision, allow_pickle=allow_pickle)
        )

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

    def wait_checkpoint(self, progress: ProgressSink | None = None) -> CheckpointResult:
        return self._client._call(self.job.wait_checkpoint(progress))

    def wait_tier(self) -> TierStatistics | None:
        return self._client._call(self.job.wait_tier())

    def events(self, since: int = 0) -> Iterator[JobEvent]:
        return self._client._iterate(self.job.events(since))

    def shards(self) -> Iterator[Shard]:
        return self._client._iterate(self.job.shards())
