"""Jobs as a caller sees them, over any transport: ``JobHandle``, ``Shard``, ``JobClient``.

A ``JobHandle`` is this side's view of the scheduler's ``SharedJob``; its events are the typed
ones of ``shardsync.events`` whether they come over the daemon's socket (each NDJSON line
parsed; a kind this version does not know is skipped) or from a scheduler in this process.
``JobClient`` submits and follows jobs over a ``Transport``; ``shardsync.Client`` is a
``JobClient`` that runs the scheduler in-process when no daemon answers. ``daemon_for``
decides, for every caller, whether the daemon serves it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, Self

from shardsync.api import (
    API_VERSION,
    CheckpointResult,
    JobRequest,
    checkpoint_result_from_json,
    result_from_json,
)
from shardsync.config import Config, Fallback, client_sockets, load_config
from shardsync.daemon_transport import (
    DaemonLease,
    DaemonTransport,
    error_from,
    hold_lease,
    socket_doubt,
)
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
from shardsync.prepared import Prepared
from shardsync.records import PrefetchResult, ProgressSink, TierStatistics
from shardsync.tasks import opened

__all__ = [
    "JobClient",
    "JobHandle",
    "Mode",
    "Shard",
    "Transport",
    "daemon_for",
    "raise_failure",
]

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
) -> JobClient | None:
    """A connected client of the daemon when one answers and serves what the caller named;
    None: do the work in this process. The one place that decides, for ``shardsync
    prefetch``, ``shardsync load`` and ``shardsync.load`` alike; the caller closes the client.

    ``cache_dir`` and ``endpoint`` are what the caller named explicitly (``--cache-dir``,
    ``cache_dir=``, ``$SHARDSYNC_CACHE_DIR``; ``--endpoint``, ``endpoint=``), None when they
    named none: a cache or Hub other than the daemon's is not the daemon's to serve. No daemon
    answering raises ``DaemonUnavailableError`` where ``config.daemon.fallback`` is "error".
    """
    client = JobClient(config, fallback="error")
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
    return not wanted or wanted == str(status.get("endpoint") or "").rstrip("/")


class Transport(Protocol):
    """How a job reaches its scheduler: the daemon's API (``DaemonTransport``), or one in
    this process (``client.LocalTransport``)."""

    @property
    def mode(self) -> Mode:
        """Which kind of transport this is."""

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]:
        """The job for ``request`` (started or joined) and whether this started it."""

    async def info(self, job_id: str) -> Mapping[str, Any]:
        """The job as ``GET /v1/jobs/{id}`` shows it."""

    async def prepare(self, request: JobRequest) -> Prepared | None:
        """What a job for ``request`` plans from: its fetch list and its shards' headers;
        None from a daemon older than ``POST /v1/prepare``."""

    async def cancel(self, job_id: str) -> Mapping[str, Any]:
        """Cancel the job for every client; its record afterwards."""

    def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]:
        """The job's events from ``since`` until its terminal one."""

    async def jobs(self) -> list[Mapping[str, Any]]:
        """Every job the scheduler keeps, unfinished ones first."""

    async def status(self) -> dict[str, Any]:
        """The scheduler's and fetcher's counters (``GET /v1/status``, less ``mode``)."""

    async def cache(self) -> dict[str, Any]:
        """The cache's summary (``GET /v1/cache``)."""


class JobHandle:
    """A handle on a job, however many clients share it; cheap to create again by id."""

    def __init__(self, transport: Transport, info: Mapping[str, Any], *, created: bool) -> None:
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
        return checkpoint_result_from_json(await self._wait_done(progress))

    async def _wait_done(self, progress: ProgressSink | None) -> Mapping[str, Any]:
        """The ``JobDone`` result object; raises the job's error."""
        driver = _ProgressDriver(progress) if progress is not None else None
        async for event in self.events():
            if driver is not None:
                driver.feed(event)
            if isinstance(event, JobDone):
                return event.result
            raise_failure(event)
        raise DaemonError(f"the event stream of job {self.id} ended without an outcome")

    async def shards(self) -> AsyncIterator[Shard]:
        """Each shard once verified, strictly in index order; raises the job's error. A
        stream that skips a shard, repeats one or names one the job does not have is a
        ``DaemonError``: a caller never ends its loop short of a shard without knowing."""
        ready: dict[int, Shard] = {}
        count = 0
        following = 0
        async for event in self.events():
            if isinstance(event, Resolved):
                count = event.shard_count
            elif isinstance(event, Verified) and (index := event.shard_index) is not None:
                if not 0 <= index < count or index < following or index in ready:
                    raise DaemonError(
                        f"job {self.id} sent shard {index} again, or one of {count} it lacks"
                    )
                ready[index] = Shard.from_event(event, index, count)
            while following in ready:
                yield ready.pop(following)
                following += 1
            if isinstance(event, JobDone):
                if following != count:
                    raise DaemonError(f"job {self.id} ended with {following} of its {count} shards")
                return
            raise_failure(event)


def raise_failure(event: JobEvent) -> None:
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


class JobClient:
    """Jobs over one transport: the daemon's when one answers, else ``_open_local``'s.

    ``config`` defaults to ``load_config(None, environ)``; ``socket`` to the configured or
    default daemon sockets; ``fallback`` to ``config.daemon.fallback``. This class has no
    in-process side (``shardsync.Client`` adds it): without a daemon it raises
    ``DaemonUnavailableError``, which is all ``daemon_for`` needs, so the loader asks for
    the daemon without depending on the scheduler.
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
        self._transport: Transport | None = None
        self.daemon_status: Mapping[str, Any] | None = None
        """The daemon's ``/v1/status`` when connecting (None in-process)."""

    @property
    def mode(self) -> Mode:
        if self._transport is None:
            raise RuntimeError("connect first: 'async with Client() as client'")
        return self._transport.mode

    async def __aenter__(self) -> Self:
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

    async def _open(self, stack: contextlib.AsyncExitStack) -> Transport:
        tried: list[str] = []
        if self._use_daemon:
            for path in client_sockets(self.config.daemon, self._environ):
                doubt = socket_doubt(path)
                if doubt is not None:
                    tried.append(f"{path} skipped: {doubt}")
                    continue
                transport = DaemonTransport(path)
                try:
                    self.daemon_status = await transport.status()
                    if self.daemon_status.get("api") != API_VERSION:  # its shapes are not ours
                        raise DaemonUnavailableError(
                            f"{path}: a daemon of API {self.daemon_status.get('api')!r}, "
                            f"not {API_VERSION}"
                        )
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
        return await self._open_local(stack)

    async def _open_local(self, stack: contextlib.AsyncExitStack) -> Transport:
        """The in-process side, when no daemon answers and the fallback allows it."""
        raise DaemonUnavailableError("no shardsync daemon answers")

    async def close(self) -> None:
        """Disconnect; in-process, this stops the jobs still running (partials are kept)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    @property
    def _connection(self) -> Transport:
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
        in_order: bool = False,
    ) -> JobHandle:
        """Start (or join) the job making ``source`` complete in the cache; with
        ``checkpoint`` (``"latest"`` or a folder name) a training checkpoint of the run at
        ``source``, or rank ``rank``'s files of it (``JobHandle.wait_checkpoint``).
        ``in_order``: the caller reads the shards in index order as each is verified, so
        they come one after another with every connection (side by side they would all
        land at the end)."""
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
            in_order=in_order,
        )
        info, created = await self._connection.submit(request)
        return JobHandle(self._connection, info, created=created)

    async def prepare(
        self, source: str, *, revision: str | None = None, allow_pickle: bool = False
    ) -> Prepared | None:
        """The fetch list of ``source`` and every safetensors shard's header, read by the
        daemon (``POST /v1/prepare``) or in this process: a stream plans its devices from
        them before it asks for the shards (``prefetch`` with the commit they came from).
        None: the daemon is older than that route; read them yourself."""
        request = JobRequest(source=source, revision=revision, allow_pickle=allow_pickle)
        return await self._connection.prepare(request)

    async def hold(self, source: str) -> DaemonLease | None:
        """A lease on ``source``'s snapshots in the daemon's cache, which the daemon holds for
        this process until it is released or the process ends (a load still reading its
        cache after the job ended); None in-process or from a daemon older than that."""
        transport = self._connection
        if not isinstance(transport, DaemonTransport):
            return None
        holding = asyncio.to_thread(hold_lease, transport.socket, JobRequest(source))
        return await opened(holding, DaemonLease.release)  # released if cancelled meanwhile

    async def job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (after a restart, the daemon keeps unfinished ids)."""
        return JobHandle(self._connection, await self._connection.info(job_id), created=False)

    async def jobs(self) -> list[Mapping[str, Any]]:
        return await self._connection.jobs()

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
            raise_failure(event)
        raise EntryNotFoundError(
            f"{filename} is not among the files prefetched from {source}"
            f"@{job.info.get('revision')} (weights, and small files matching include)"
        )

    async def status(self) -> dict[str, Any]:
        """The daemon's statistics (``GET /v1/status``), or this process's scheduler's."""
        return {"mode": self.mode, **(await self._connection.status())}

    async def cache(self) -> dict[str, Any]:
        """The daemon's cache summary (``GET /v1/cache``); in-process, this cache's."""
        return await self._connection.cache()
