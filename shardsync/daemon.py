"""``shardsync daemon``: the scheduler behind a private, versioned JSON API.

One process per host downloads each byte once for every client. It listens on a Unix socket
in a directory only its user (and, with ``daemon.group``, that group) can traverse, and checks
each request's peer credentials (``SO_PEERCRED``) against the configured uids and gids; the
daemon's own user and root are always allowed. An optional TCP listener (loopback unless
explicitly allowed) serves only ``/metrics`` and ``/v1/status``: TCP has no peer credentials,
so nothing that starts work or names a repository is reachable over it.

Routes (see the README for the shapes)::

    POST   /v1/prepare              a model's fetch list and shard headers, for a stream
    POST   /v1/leases               lease a repo's snapshots here while the request is open
    POST   /v1/jobs                 submit (or join) a prefetch job
    GET    /v1/jobs                 every known job
    GET    /v1/jobs/{id}            one job
    DELETE /v1/jobs/{id}            cancel it (for every client)
    GET    /v1/jobs/{id}/events     NDJSON: past events, then live ones, until the job ends
    GET    /v1/cache                cache usage
    GET    /v1/status               daemon statistics
    GET    /metrics                 Prometheus text format

Errors are ``{"error": {"code": ..., "message": ...}}`` with a 4xx status for anything the
client got wrong. SIGTERM stops taking jobs, interrupts the running ones (partial files and
the journal are kept, so they resume on the next start) and exits; SIGHUP reloads the
config's live settings (allowed peers, bandwidth, history).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from shardsync import strict_json
from shardsync.api import API_VERSION, JobRequest, error_json
from shardsync.checkpoint_selection import selection_for
from shardsync.config import Config, daemon_socket, load_config
from shardsync.errors import (
    CacheError,
    ConfigError,
    DaemonStoppingError,
    JobCancelledError,
    ManifestError,
    ShardsyncError,
)
from shardsync.inventory import cache_summary
from shardsync.journal import Journal
from shardsync.limits import TokenBucket
from shardsync.listeners import bind_tcp, bind_unix, host_port, unlink_socket
from shardsync.metrics import DaemonStatistics, render_metrics
from shardsync.notify import Notifier
from shardsync.prefetch import Engine
from shardsync.prune import CacheRoom
from shardsync.scheduler import Scheduler, SharedJob
from shardsync.snapshot_use import Lease, Leases
from shardsync.version import __version__

__all__ = ["API_VERSION", "Daemon", "DaemonStatistics", "run_daemon"]

log = logging.getLogger("shardsync.daemon")

_MAX_BODY = 64 * 1024
_STOP_TIMEOUT = 8.0  # the shutdown's own steps; systemd's TimeoutStopSec is longer
_EXIT_GRACE = 2.0  # then the process leaves whatever still runs (a step that never gives way)
_TCP_ROUTES = frozenset({"/metrics", "/v1/status"})
_NDJSON = "application/x-ndjson"
_CACHE_TTL = 10.0
_HEARTBEAT_S = 15.0  # an event stream silent this long gets an empty line (clients skip it)
_IDLE_S = 10.0  # a connection with no request in flight this long is closed (a silent one too)


class Daemon:
    """The daemon's state; ``serve()`` runs it until ``request_stop()``."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.environ = dict(os.environ if environ is None else environ)
        self.socket_path = daemon_socket(config.daemon, self.environ)
        self.tcp_address: tuple[str, int] | None = None
        self.notifier = Notifier(self.environ)
        self.bucket = TokenBucket(config.daemon.max_bandwidth)
        self._stop = asyncio.Event()
        self._ready = asyncio.Event()
        self._holds: set[Lease] = set()  # the leases of open ``POST /v1/leases`` requests
        self._started = time.monotonic()
        self._requests = 0
        self._engine: Engine | None = None
        self._scheduler: Scheduler | None = None
        self._cache_memo: tuple[float, object, asyncio.Future[dict[str, Any]]] | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Bind, resume journaled jobs, say READY, serve until stopped, then shut down.

        The shutdown (interrupt jobs, answer their waiters, close connections and the
        engine) is bounded by ``_STOP_TIMEOUT`` so the process always exits promptly.
        """
        try:
            async with asyncio.timeout(None) as deadline, contextlib.AsyncExitStack() as stack:
                unix, inode, lock = bind_unix(self.socket_path, self.config)
                stack.callback(os.close, lock)  # last: the socket file goes first
                stack.callback(unlink_socket, self.socket_path, inode)
                stack.callback(unix.close)  # closing twice is harmless; a failed start needs it
                tcp = None
                if self.config.daemon.tcp is not None:
                    tcp = bind_tcp(*self.config.daemon.tcp)
                    stack.callback(tcp.close)
                    self.tcp_address = tcp.getsockname()[:2]
                await self._start(stack, unix, tcp)
                await self._stop.wait()
                deadline.reschedule(asyncio.get_running_loop().time() + _STOP_TIMEOUT)
                log.info("stopping: interrupting unfinished jobs (they resume on the next start)")
                self.notifier.stopping("stopping; unfinished jobs resume on the next start")
                self._sched.stop(
                    DaemonStoppingError(
                        "daemon stopping: the job is kept and resumes when the daemon starts again"
                    )
                )
        except TimeoutError:
            log.error("shutdown took longer than %.0f s; exiting anyway", _STOP_TIMEOUT)
        log.info("stopped")

    async def _start(
        self, stack: contextlib.AsyncExitStack, unix: socket.socket, tcp: socket.socket | None
    ) -> None:
        """Everything ``serve`` runs, entered on ``stack`` so it unwinds in reverse order:
        the scheduler (jobs interrupted) before the HTTP server, before the engine."""
        engine = await stack.enter_async_context(Engine(self.config, throttle=self.bucket))
        runner = web.AppRunner(
            self._app(), access_log=None, shutdown_timeout=2.0, keepalive_timeout=_IDLE_S
        )
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        stack.callback(self._let_go)  # a stop ends the lease requests, and so their leases
        journal = Journal(engine.store)
        scheduler = Scheduler(
            engine,
            selections=selection_for,
            room=CacheRoom(engine.store, engine.config.prune),
            journal=journal,
            history=self.config.daemon.history,
            allow_local=False,
            on_change=lambda: self.notifier.status(self._status_line()),
        )
        await stack.enter_async_context(scheduler)
        self._engine, self._scheduler = engine, scheduler
        restored = await scheduler.restore()
        await web.SockSite(runner, unix).start()
        if tcp is not None:
            await web.SockSite(runner, tcp).start()
        log.info(
            "serving on %s%s; cache %s; %d journaled job(s) resumed",
            self.socket_path,
            f" and http://{host_port(self.tcp_address)}" if self.tcp_address else "",
            self.config.cache_dir,
            restored,
        )
        self.notifier.ready(self._status_line())
        self._ready.set()

    async def wait_ready(self) -> None:
        """Until the socket answers (for embedding the daemon, e.g. in tests)."""
        await self._ready.wait()

    def request_stop(self) -> None:
        self._stop.set()

    def reload(self) -> None:
        """SIGHUP: apply the live settings of the config file; the rest needs a restart."""
        self.notifier.reloading()
        try:
            new = load_config(self.config_path, self.environ)
        except ConfigError as exc:
            log.error("config reload failed, keeping the running config: %s", exc)
            self.notifier.ready(self._status_line())
            return
        old = self.config
        live = replace(
            old.daemon,
            allowed_uids=new.daemon.allowed_uids,
            allowed_gids=new.daemon.allowed_gids,
            max_bandwidth=new.daemon.max_bandwidth,
            history=new.daemon.history,
            fallback=new.daemon.fallback,
        )
        if new != replace(old, daemon=live):
            log.warning("config reload: cache, download and socket settings apply on restart")
        self.config = replace(old, daemon=live)
        self.bucket.set_rate(live.max_bandwidth)
        if self._scheduler is not None:
            self._scheduler.history = live.history
        log.info("config reloaded")
        self.notifier.ready(self._status_line())

    def statistics(self) -> DaemonStatistics:
        fetch = self._engine.fetcher.statistics() if self._engine is not None else None
        sched = self._scheduler.statistics() if self._scheduler is not None else None
        return DaemonStatistics(
            version=__version__,
            api=API_VERSION,
            pid=os.getpid(),
            uptime_s=round(time.monotonic() - self._started, 3),
            socket=str(self.socket_path),
            tcp=host_port(self.tcp_address) if self.tcp_address else None,
            cache_dir=os.path.abspath(self.config.cache_dir),
            endpoint=self.config.endpoint,
            stopping=self._stop.is_set(),
            jobs=dict(sched.jobs) if sched else {},
            jobs_submitted=sched.jobs_submitted if sched else 0,
            jobs_deduplicated=sched.jobs_deduplicated if sched else 0,
            files_waiting=sched.files_waiting if sched else 0,
            api_requests=self._requests,
            bytes_downloaded=fetch.bytes_downloaded if fetch else 0,
            files_fetched=fetch.files_fetched if fetch else 0,
            active_connections=fetch.active_connections if fetch else 0,
            retries=dict(fetch.retries) if fetch else {},
            verify_failures=fetch.verify_failures if fetch else 0,
            max_bandwidth=int(self.bucket.rate),
            tier=self._engine.tier.statistics()
            if self._engine is not None and self._engine.tier is not None
            else None,
        )

    def _status_line(self) -> str:
        jobs = self._scheduler.statistics().jobs if self._scheduler else {}
        active = sum(jobs.get(s, 0) for s in ("pending", "resolving", "downloading"))
        return f"serving on {self.socket_path}; {active} active job(s)"

    # -- HTTP ---------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._guard], client_max_size=_MAX_BODY)
        app.router.add_post("/v1/prepare", self._prepare)
        app.router.add_post("/v1/leases", self._hold)
        app.router.add_post("/v1/jobs", self._submit)
        app.router.add_get("/v1/jobs", self._list)
        app.router.add_get("/v1/jobs/{id}", self._get)
        app.router.add_delete("/v1/jobs/{id}", self._cancel)
        app.router.add_get("/v1/jobs/{id}/events", self._events)
        app.router.add_get("/v1/cache", self._cache)
        app.router.add_get("/v1/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every error is a JSON body with a code; nothing a client sends makes a 500."""
        self._requests += 1
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = _HTTP_CODES.get(exc.status, "bad_request")
            return _error(exc.status, code, exc.text or exc.reason)
        except ShardsyncError as exc:
            return _error(_status_for(exc), **error_json(exc))
        except Exception:
            log.exception("internal error answering %s %s", request.method, request.path)
            return _error(500, "internal", "internal error; see the daemon's log")
        finally:
            self._requests -= 1

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Peer credentials on the Unix socket; read-only monitoring routes over TCP."""
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None:
            raise web.HTTPForbidden(text="cannot identify the peer")
        if sock.family == socket.AF_UNIX:
            pid, uid, gid = _peer_credentials(sock)
            if not self._allowed(pid, uid, gid):
                log.warning("refused uid %d gid %d (pid %d)", uid, gid, pid)
                return _error(
                    403,
                    "forbidden",
                    f"uid {uid} is not allowed to use this daemon; add it (or one of its "
                    "groups) to daemon.allowed_uids/allowed_gids",
                )
        elif request.path not in _TCP_ROUTES or request.method != "GET":
            return _error(
                403,
                "forbidden",
                "the TCP listener serves only GET /metrics and /v1/status; "
                "use the Unix socket for the API",
            )
        return await handler(request)

    def _allowed(self, pid: int, uid: int, gid: int) -> bool:
        cfg = self.config.daemon
        if uid in (0, os.geteuid()) or uid in cfg.allowed_uids or gid in cfg.allowed_gids:
            return True
        return bool(cfg.allowed_gids) and bool(_supplementary_groups(pid) & cfg.allowed_gids)

    @property
    def _sched(self) -> Scheduler:
        if self._scheduler is None:
            raise DaemonStoppingError("the daemon is not serving")
        return self._scheduler

    async def _prepare(self, request: web.Request) -> web.Response:
        wanted = JobRequest.from_json(await _json_body(request))
        if wanted.checkpoint is not None:
            raise ConfigError("prepare reads a model's headers, not a training checkpoint's")
        if self._engine is None:
            raise DaemonStoppingError("the daemon is not serving")
        origin = self._engine.origin(wanted.source)
        if origin.caller_only:
            raise ConfigError("the daemon does not read local directories on a client's behalf")
        prepared = await self._engine.prepare(
            origin, revision=wanted.revision, allow_pickle=wanted.allow_pickle
        )
        return web.json_response(prepared.to_json())

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        """Lease a repo's snapshots in this cache for a client (a load still placing tensors
        from it after its job ended) while the client keeps this request open: its close,
        or this daemon stopping, lets go of it. The lease also follows the client's
        process, so a ``kill -9`` of either ends it too."""
        wanted = JobRequest.from_json(await _json_body(request))
        if self._engine is None:
            raise DaemonStoppingError("the daemon is not serving")
        repo = self._engine.origin(wanted.source).repo
        assert request.transport is not None  # the guard let a Unix socket's peer in
        pid = _peer_credentials(request.transport.get_extra_info("socket"))[0]
        leases = Leases(self._engine.cache)
        try:
            lease = await leases.ahold(repo, owner=f"load by pid {pid}", pid=pid)
        except CacheError:  # its process hidden from ours (/proc's hidepid): follows ours
            lease = await leases.ahold(repo, owner=f"load by pid {pid}")
        self._holds.add(lease)
        response = web.StreamResponse(status=201, headers={"Cache-Control": "no-store"})
        try:
            await response.prepare(request)
            while True:  # a heartbeat: the client's going is found at the next one
                await response.write(b"\n")
                await asyncio.sleep(_HEARTBEAT_S)
        except ConnectionError:
            pass
        finally:
            self._holds.discard(lease)
            lease.release()
        return response

    def _let_go(self) -> None:
        for lease in self._holds:
            lease.release()
        self._holds.clear()

    async def _submit(self, request: web.Request) -> web.Response:
        job, created = await self._sched.submit(JobRequest.from_json(await _json_body(request)))
        return web.json_response(job.info(), status=201 if created else 200)

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"jobs": [job.info() for job in self._sched.jobs()]})

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).info())

    async def _cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        await self._sched.cancel(job.id)
        return web.json_response(job.info())

    async def _events(self, request: web.Request) -> web.StreamResponse:
        job = self._job(request)
        since_text = request.query.get("since", "0")
        if not (since_text.isascii() and since_text.isdigit()) or len(since_text) > 12:
            return _error(400, "bad_request", "since must be a non-negative event number")
        since = int(since_text)
        response = web.StreamResponse(
            headers={"Content-Type": _NDJSON, "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        events = aiter(job.events.follow(since))
        upcoming = asyncio.ensure_future(anext(events))
        try:
            while True:
                # a silent job's stream writes an empty line now and then: a client that went
                # away is found then, not at the job's next event (hours, for a queued one)
                if not (await asyncio.wait({upcoming}, timeout=_HEARTBEAT_S))[0]:
                    await response.write(b"\n")
                    continue
                try:
                    event = upcoming.result()
                except StopAsyncIteration:
                    break
                line = json.dumps(event.to_json(), separators=(",", ":"))
                await response.write(line.encode() + b"\n")
                upcoming = asyncio.ensure_future(anext(events))
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away; the job goes on
        finally:
            upcoming.cancel()
        return response

    async def _cache(self, request: web.Request) -> web.Response:
        return web.json_response(await self._cache_summary())

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(asdict(self.statistics()))

    async def _metrics(self, request: web.Request) -> web.Response:
        summary = await self._cache_summary()
        text = render_metrics(self.statistics(), self._sched, summary)
        return web.Response(
            body=text.encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    def _job(self, request: web.Request) -> SharedJob:
        job = self._sched.get(request.match_info["id"])
        if job is None:
            raise web.HTTPNotFound(text=f"no job {request.match_info['id'][:64]!r}")
        return job

    async def _cache_summary(self) -> dict[str, Any]:
        """Walking the store costs a directory scan: scrapes within ``_CACHE_TTL`` share one,
        unless a file was fetched or a job changed state since (so ``status`` right after a
        job shows what it added)."""
        now = time.monotonic()
        stats = self.statistics()
        generation = (stats.files_fetched, tuple(sorted(stats.jobs.items())))
        memo = self._cache_memo
        failed = memo is not None and memo[2].done() and memo[2].exception() is not None
        if memo is None or failed or now - memo[0] > _CACHE_TTL or memo[1] != generation:
            # one scan at a time, shared by every request that comes meanwhile (a burst of
            # scrapes would otherwise fill the worker threads the jobs' own steps wait for)
            scan = asyncio.ensure_future(asyncio.to_thread(cache_summary, self.config.cache_dir))
            self._cache_memo = memo = (now, generation, scan)
        return await asyncio.shield(memo[2])


# ------------------------------------------------------------------------- peer credentials


_CRED = struct.Struct("3i")


def _peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(pid), int(uid), int(gid)


def _supplementary_groups(pid: int) -> frozenset[int]:
    """The peer's supplementary groups (SO_PEERCRED gives only its primary gid)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:] if g.isdigit())
    except OSError:
        pass
    return frozenset()


# ---------------------------------------------------------------------------------- answers


_HTTP_CODES = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def _json_body(request: web.Request) -> object:
    try:
        return strict_json.loads(await request.read())
    except strict_json.StrictJSONError as exc:
        raise web.HTTPBadRequest(text=f"the body is not valid JSON: {exc}") from exc


def _status_for(exc: ShardsyncError) -> int:
    if isinstance(exc, DaemonStoppingError):
        return 503
    if isinstance(exc, ConfigError | ManifestError):
        return 400
    if isinstance(exc, JobCancelledError):
        return 409
    return 500


# ---------------------------------------------------------------------------------- entry


def run_daemon(config_path: Path | None, environ: Mapping[str, str] | None = None) -> int:
    """``shardsync daemon``: serve until SIGTERM/SIGINT; SIGHUP reloads. Returns the exit code."""
    env = os.environ if environ is None else environ
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    config = load_config(config_path, env)
    daemon = Daemon(config, config_path=config_path, environ=env)

    deadline: list[threading.Timer] = []

    def stop() -> None:
        daemon.request_stop()
        if not deadline:
            deadline.append(threading.Timer(_STOP_TIMEOUT + _EXIT_GRACE, _exit_now))
            deadline[0].daemon = True
            deadline[0].start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop)
        loop.add_signal_handler(signal.SIGINT, stop)
        loop.add_signal_handler(signal.SIGHUP, daemon.reload)
        await daemon.serve()

    asyncio.run(main())
    for timer in deadline:
        timer.cancel()
    return 0


def _exit_now() -> None:
    """The stop's bound passed: a step that runs to its end (a publish whose fsync a stalled
    disk holds, a worker thread) still runs. Leave without it, as a ``kill -9`` would (and
    systemd would, later): the journal and the partial files resume the jobs."""
    log.error(
        "shutdown took longer than %.0f s; exiting now (unfinished jobs resume on the next start)",
        _STOP_TIMEOUT + _EXIT_GRACE,
    )
    os._exit(0)
