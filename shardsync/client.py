"""``shardsync.Client``: ask the daemon for models, or run the engine in-process without one.

::

    async with shardsync.Client() as client:
        job = await client.prefetch("org/model", priority=10)
        async for shard in job.shards():       # each verified shard, in index order
            load(shard.file)
        result = await job.wait()              # a PrefetchResult, like shardsync.prefetch's
        config = await client.wait_file("org/model", "config.json")

The same calls work whether a daemon answers or not: without one (and with the default
``fallback = "in-process"``) the client runs the same scheduler on its own engine, so jobs,
events and results are identical; only the dedup across processes is then left to the
cache's per-blob locks. Errors are the project's own exceptions carrying the daemon's message.
``SyncClient`` offers the same API to code without an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import aiohttp

from shardsync.api import JobRequest, error_class, result_from_json
from shardsync.config import Config, Fallback, client_sockets, load_config
from shardsync.errors import (
    DaemonError,
    DaemonUnavailableError,
    EntryNotFoundError,
    ShardsyncError,
)
from shardsync.prefetch import Engine
from shardsync.records import FileOutcome, PrefetchResult, ProgressSink
from shardsync.scheduler import TERMINAL_EVENTS, ScheduledJob, Scheduler

if TYPE_CHECKING:
    from shardsync.checkpoint import CheckpointResult

__all__ = ["Client", "Job", "Shard", "SyncClient", "SyncJob", "daemon_serves"]

_T = TypeVar("_T")
_BASE = "http://shardsync"
_MAX_LINE = 64 << 20
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=5)
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
_NOT_THERE = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES})

Event = dict[str, Any]
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


def daemon_serves(
    status: Mapping[str, Any], *, cache_dir: str | os.PathLike[str] | None, endpoint: str | None
) -> bool:
    """Whether a daemon (its ``GET /v1/status``) serves what a caller named: the rule that
    ``shardsync prefetch`` and ``shardsync load``/``shardsync.load`` share.

    ``cache_dir`` and ``endpoint`` are what the caller named explicitly (``--cache-dir``,
    ``cache_dir=``, ``$SHARDSYNC_CACHE_DIR``; ``--endpoint``, ``endpoint=``), None when they
    named none. A cache or Hub other than the daemon's is not the daemon's to serve.
    """
    if cache_dir is not None and status.get("cache_dir") != os.path.abspath(cache_dir):
        return False
    wanted = (endpoint or "").rstrip("/")
    return not wanted or wanted == (status.get("endpoint") or "").rstrip("/")


def error_from(error: Mapping[str, Any]) -> ShardsyncError:
    """The exception for an API error object (``{"code", "message"}``)."""
    code, message = str(error.get("code", "")), str(error.get("message", ""))
    cls = error_class(code)
    if cls is None:
        return DaemonError(f"{message} ({code})" if code else message)
    return cls(message)


class _Transport(Protocol):
    """How a job reaches its scheduler: the daemon's API, or one in this process."""

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]: ...

    async def info(self, job_id: str) -> Mapping[str, Any]: ...

    async def cancel(self, job_id: str) -> Mapping[str, Any]: ...

    def events(self, job_id: str, since: int) -> AsyncIterator[Event]: ...


class Job:
    """A handle on a job, however many clients share it; cheap to create again by id."""

    def __init__(self, transport: _Transport, info: Mapping[str, Any], *, created: bool) -> None:
        self._transport = transport
        self.id: str = str(info["id"])
        self.info: Mapping[str, Any] = info
        """The job as it was when this handle was made (``refresh()`` for a new one)."""
        self.created = created
        """Whether this request started the job (False: it joined one already running)."""

    def __repr__(self) -> str:
        return f"<shardsync.Job {self.id} {self.info.get('repo')}@{self.info.get('revision')}>"

    async def refresh(self) -> Mapping[str, Any]:
        self.info = await self._transport.info(self.id)
        return self.info

    async def cancel(self) -> None:
        """Cancel the job for every client; partial files stay for a later run."""
        self.info = await self._transport.cancel(self.id)

    async def events(self, since: int = 0) -> AsyncIterator[Event]:
        """The job's events from ``since``: past ones first, then live, ending with
        ``job_done`` or ``job_failed``."""
        async for event in self._transport.events(self.id, since):
            yield event

    async def wait(self, progress: ProgressSink | None = None) -> PrefetchResult:
        """The complete snapshot; raises the job's error. ``progress`` gets the engine's
        progress calls, rebuilt from the events (the CLI draws its bars with it)."""
        driver = _ProgressDriver(progress) if progress is not None else None
        async for event in self.events():
            if driver is not None:
                driver.feed(event)
            outcome = _outcome(event)
            if outcome is not None:
                return outcome
        raise DaemonError(f"the event stream of job {self.id} ended without an outcome")

    async def wait_checkpoint(self, progress: ProgressSink | None = None) -> CheckpointResult:
        """A training checkpoint job's outcome: which checkpoint, its local folder."""
        from shardsync.checkpoint import checkpoint_result_from_json

        driver = _ProgressDriver(progress) if progress is not None else None
        async for event in self.events():
            if driver is not None:
                driver.feed(event)
            if event["event"] == "job_done":
                return checkpoint_result_from_json(event["result"])
            _outcome(event)  # raises for job_failed
        raise DaemonError(f"the event stream of job {self.id} ended without an outcome")

    async def shards(self) -> AsyncIterator[Shard]:
        """Each shard once verified, strictly in index order; raises the job's error."""
        ready: dict[int, Shard] = {}
        count = 0
        following = 0
        async for event in self.events():
            kind = event["event"]
            if kind == "resolved":
                count = sum(1 for f in event["files"] if f["shard_index"] is not None)
            elif kind == "verified" and event["shard_index"] is not None:
                ready[event["shard_index"]] = _shard(event, count)
            while following in ready:
                yield ready.pop(following)
                following += 1
            if _outcome(event) is not None:
                return


def _outcome(event: Event) -> PrefetchResult | None:
    """The result of a ``job_done`` event; raises for ``job_failed``; None otherwise."""
    if event["event"] == "job_done":
        return result_from_json(event["result"])
    if event["event"] == "job_failed":
        raise error_from(event["error"])
    return None


def _shard(event: Event, count: int) -> Shard:
    return Shard(
        path=event["path"],
        index=event["shard_index"],
        count=count,
        file=Path(event["file"]),
        size=event["size"],
        sha256=event["sha256"],
    )


class _ProgressDriver:
    """Replays events as ``ProgressSink`` calls in the order the engine makes them."""

    def __init__(self, sink: ProgressSink) -> None:
        self._sink = sink
        self._done: dict[str, int] = {}

    def _add(self, path: str, size: int | None) -> None:
        if path not in self._done:
            self._done[path] = 0
            self._sink.add_file(path, size)

    def feed(self, event: Event) -> None:
        kind = event["event"]
        if kind == "resolved":
            for f in event["files"]:
                self._add(f["path"], f["size"])
        elif kind == "file_started":
            self._add(event["path"], event["size"])
        elif kind in ("progress", "verified"):
            path = event["path"]
            self._add(path, event["size"])
            done = event["done"] if kind == "progress" else event["size"]
            if done != self._done[path]:
                self._sink.advance(path, done - self._done[path])
                self._done[path] = done
            if kind == "verified":
                self._sink.file_done(
                    FileOutcome(
                        path=path,
                        size=event["size"],
                        sha256=event["sha256"],
                        verified=event["verified"],
                        source=event["source"],
                        downloaded=event["downloaded"],
                        resumed=event["resumed"],
                    )
                )


# ---------------------------------------------------------------------------------- transports


class _DaemonTransport:
    """The daemon's JSON API over its Unix socket."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(socket)), timeout=_REQUEST_TIMEOUT
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        try:
            async with self._session.request(method, _BASE + path, json=body) as resp:
                data = await resp.read()
                status = resp.status
        except aiohttp.ClientConnectorError as exc:
            if exc.os_error.errno in _NOT_THERE:
                raise DaemonUnavailableError(f"no daemon at {self.socket}: {exc.strerror}") from exc
            raise DaemonError(f"cannot reach the daemon at {self.socket}: {exc}") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DaemonError(f"the daemon at {self.socket} did not answer: {exc!r}") from exc
        try:
            obj = json.loads(data)
        except ValueError as exc:
            raise DaemonError(f"the daemon answered {status} with a body that is not JSON") from exc
        if status >= 400:
            error = obj.get("error") if isinstance(obj, dict) else None
            raise error_from(error if isinstance(error, dict) else {"message": f"HTTP {status}"})
        return status, obj

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]:
        status, info = await self.request("POST", "/v1/jobs", request.to_json())
        return info, status == 201

    async def info(self, job_id: str) -> Mapping[str, Any]:
        _, info = await self.request("GET", f"/v1/jobs/{job_id}")
        return dict(info)

    async def cancel(self, job_id: str) -> Mapping[str, Any]:
        _, info = await self.request("DELETE", f"/v1/jobs/{job_id}")
        return dict(info)

    async def events(self, job_id: str, since: int) -> AsyncIterator[Event]:
        url = f"{_BASE}/v1/jobs/{job_id}/events"
        try:
            async with self._session.get(
                url, params={"since": str(since)}, timeout=_STREAM_TIMEOUT
            ) as resp:
                if resp.status >= 400:
                    body = await resp.read()
                    with contextlib.suppress(ValueError):
                        error = json.loads(body).get("error")
                        if isinstance(error, dict):
                            raise error_from(error)
                    raise DaemonError(f"the daemon answered {resp.status} for job {job_id}")
                async for event in _ndjson(resp):
                    yield event
                    if event.get("event") in TERMINAL_EVENTS:
                        return
        except aiohttp.ClientError as exc:
            reason = str(exc) or type(exc).__name__
            raise DaemonError(
                f"lost the daemon while following job {job_id} ({reason}); it may have stopped "
                "or crashed: `shardsync status` tells, and the job resumes when it is back"
            ) from exc
        raise DaemonError(f"the daemon closed the event stream of job {job_id} before it ended")


async def _ndjson(resp: aiohttp.ClientResponse) -> AsyncIterator[Event]:
    """Objects of a newline-delimited JSON body (no line-length limit below ``_MAX_LINE``)."""
    buffer = bytearray()
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while (newline := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:newline])
            del buffer[: newline + 1]
            if line.strip():
                try:
                    event = json.loads(line)
                except ValueError as exc:
                    raise DaemonError("the daemon sent a malformed event") from exc
                if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                    raise DaemonError("the daemon sent an event without a type")
                yield event
        if len(buffer) > _MAX_LINE:
            raise DaemonError("the daemon sent an event line larger than 64 MiB")


class _LocalTransport:
    """A scheduler in this process: what the client runs when no daemon answers."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def _job(self, job_id: str) -> ScheduledJob:
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

    async def events(self, job_id: str, since: int) -> AsyncIterator[Event]:
        async for event in self._job(job_id).events.follow(since):
            yield dict(event)


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
        self._transport: _DaemonTransport | _LocalTransport | None = None
        self.daemon_status: Mapping[str, Any] | None = None
        """The daemon's ``/v1/status`` when connecting (None in-process)."""

    @property
    def mode(self) -> Mode:
        if self._transport is None:
            raise RuntimeError("connect first: 'async with Client() as client'")
        return "daemon" if isinstance(self._transport, _DaemonTransport) else "in-process"

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

    async def _open(self, stack: contextlib.AsyncExitStack) -> _DaemonTransport | _LocalTransport:
        tried: list[str] = []
        if self._use_daemon:
            for path in client_sockets(self.config.daemon, self._environ):
                transport = _DaemonTransport(path)
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
            Scheduler(engine, history=self.config.daemon.history)
        )
        return _LocalTransport(scheduler)

    async def close(self) -> None:
        """Disconnect; in-process, this stops the jobs still running (partials are kept)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @property
    def _t(self) -> _DaemonTransport | _LocalTransport:
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
    ) -> Job:
        """Start (or join) the job making ``source`` complete in the cache; with
        ``checkpoint`` (``"latest"`` or a folder name) a training checkpoint of the run at
        ``source``, or rank ``rank``'s files of it (``Job.wait_checkpoint``)."""
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
        info, created = await self._t.submit(request)
        return Job(self._t, info, created=created)

    async def job(self, job_id: str) -> Job:
        """A handle on an existing job (after a restart, the daemon keeps unfinished ids)."""
        return Job(self._t, await self._t.info(job_id), created=False)

    async def jobs(self) -> list[Mapping[str, Any]]:
        if isinstance(self._t, _LocalTransport):
            return [job.info() for job in self._t.scheduler.jobs()]
        return list((await self._t.request("GET", "/v1/jobs"))[1]["jobs"])

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
            kind = event["event"]
            if kind == "verified" and event["path"] == filename:
                return Path(event["file"])
            if kind == "resolved" and filename not in {f["path"] for f in event["files"]}:
                break
            _outcome(event)
            if kind == "job_done":
                break
        raise EntryNotFoundError(
            f"{filename} is not among the files prefetched from {source}"
            f"@{job.info.get('revision')} (weights, and small files matching include)"
        )

    async def status(self) -> dict[str, Any]:
        """The daemon's statistics (``GET /v1/status``), or this process's scheduler's."""
        if isinstance(self._t, _LocalTransport):
            scheduler = self._t.scheduler
            fetch = scheduler.engine.fetcher.statistics()
            stats = scheduler.statistics()
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
            }
        return {"mode": "daemon", **(await self._t.request("GET", "/v1/status"))[1]}

    async def cache(self) -> dict[str, Any]:
        """The daemon's cache summary (``GET /v1/cache``); in-process, this cache's."""
        if isinstance(self._t, _LocalTransport):
            from shardsync.daemon import cache_summary

            return await asyncio.to_thread(cache_summary, self.config.cache_dir)
        return dict((await self._t.request("GET", "/v1/cache"))[1])


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
    ) -> SyncJob:
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
        return SyncJob(self, job)

    def job(self, job_id: str) -> SyncJob:
        return SyncJob(self, self._call(self._client.job(job_id)))

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


class SyncJob:
    """``Job`` with blocking methods and plain iterators."""

    def __init__(self, client: SyncClient, job: Job) -> None:
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

    def events(self, since: int = 0) -> Iterator[Event]:
        return self._client._iterate(self.job.events(since))

    def shards(self) -> Iterator[Shard]:
        return self._client._iterate(self.job.shards())
