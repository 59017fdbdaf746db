"""The client's side of the daemon's API: JSON over HTTP on the daemon's Unix socket.

``DaemonTransport`` sends the requests, turns an error answer (``{"error": {"code",
"message"}}``) into the project's exception for its code (``error_from``), and reads a job's
events from the NDJSON stream, one typed event a line (a kind this version does not know is
skipped) until the job ends. A socket nobody listens on is ``DaemonUnavailableError``; a
daemon that answers badly or goes away is ``DaemonError``.

HTTP/1.1 is spoken with h11 over asyncio's Unix streams, not aiohttp: a command that hands
its work to the daemon then imports neither aiohttp nor botocore (about 0.15 s of a
``shardsync prefetch``'s start).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import stat
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import h11

from shardsync.api import JobRequest, error_class
from shardsync.errors import DaemonError, DaemonUnavailableError, ShardsyncError
from shardsync.events import TERMINAL_EVENTS, ErrorInfo, JobEvent, parse_event
from shardsync.prepared import Prepared

__all__ = ["DaemonTransport", "error_from"]

_MAX_LINE = 64 << 20
_MAX_HEAD = 64 << 10
_CONNECT_TIMEOUT_S = 5.0
_REQUEST_TIMEOUT_S = 60.0
_PREPARE_TIMEOUT_S = 600.0
"""A prepare waits on the origin (listing, index, headers) under the daemon's own retries,
whose backoff alone may add up to more than a minute; this bound is for a daemon that stops
answering, not for a slow origin."""
_STREAM_IDLE_S = 45.0
"""An event stream silent this long (three of the daemon's 15 s heartbeats) is a daemon
that froze (SIGSTOP, a stuck loop): lost, like one whose connection dropped."""
_READ = 1 << 16
_NOT_THERE = frozenset(
    {errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES, errno.ENAMETOOLONG}
)
_SUN_PATH = 108
"""The most bytes an AF_UNIX path has (Linux): no daemon listens at a longer one, and
Python says so with an ``OSError`` that has no errno."""


def error_from(error: ErrorInfo) -> ShardsyncError:
    """The exception for an API error object (``{"code", "message"}``)."""
    cls = error_class(error.code)
    if cls is None:
        return DaemonError(f"{error.message} ({error.code})" if error.code else error.message)
    return cls(error.message)


class _Exchange:
    """One request and its answer on a connection of its own (h11 over the socket's
    streams): a local socket costs nothing to open, and no pool outlives a command."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        self.status = 0
        self.idle_s: float | None = None
        """A deadline for each read (``TimeoutError``); None: the caller's alone."""

    async def send(self, method: str, target: str, body: bytes | None) -> None:
        headers = [("Host", "shardsync"), ("Connection", "close")]
        if body is not None:
            headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        data = self._h11.send(h11.Request(method=method, target=target, headers=headers)) or b""
        if body:
            data += self._h11.send(h11.Data(data=body)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        self._writer.write(data)
        await self._writer.drain()
        while not isinstance(event := await self._next(), h11.Response):
            if not isinstance(event, h11.InformationalResponse):
                raise h11.RemoteProtocolError("no response head")
        self.status = event.status_code

    async def chunks(self) -> AsyncIterator[bytes]:
        """The answer's body as it comes; it ends with the message (a daemon going away
        before the end raises ``h11.RemoteProtocolError``)."""
        while isinstance(event := await self._next(), h11.Data):
            yield bytes(event.data)
        if not isinstance(event, h11.EndOfMessage):
            raise h11.RemoteProtocolError("the answer ended early")

    async def body(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    async def _next(self) -> Any:
        while (event := self._h11.next_event()) is h11.NEED_DATA:
            async with asyncio.timeout(self.idle_s):
                data = await self._reader.read(_READ)
            self._h11.receive_data(data)
        return event

    def close(self) -> None:
        self._writer.close()


def socket_doubt(path: Path, euid: int | None = None) -> str | None:
    """Why a daemon socket at ``path`` could be another user's trap, or None. Anyone may
    create ``/tmp/shardsync-$UID/`` before its user does and answer there with files of
    their choosing, so a socket is used only from a directory no other user may write, and
    one inside a shared directory (``/tmp``) only if it is this user's or root's. The
    daemon keeps its own directory so (``listeners.bind_unix``)."""
    euid = os.geteuid() if euid is None else euid
    directory = path.parent
    try:
        shared = directory.parent.stat().st_mode & stat.S_IWOTH
        st = directory.lstat() if shared else directory.stat()
    except OSError:
        return None  # nothing there: connecting finds no daemon
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    if st.st_mode & 0o022:
        return f"{directory} may be written by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    if shared and st.st_uid not in (euid, 0):
        return f"{directory}, in the shared {directory.parent}, belongs to uid {st.st_uid}"
    return None


class DaemonTransport:
    """The daemon's JSON API over its Unix socket."""

    mode: Literal["daemon"] = "daemon"

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    async def close(self) -> None:
        """Nothing to close: each request has its own connection."""

    @asynccontextmanager
    async def _exchange(self) -> AsyncIterator[_Exchange]:
        """A fresh connection for one request (``DaemonUnavailableError`` if nobody
        listens)."""
        try:
            async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_unix_connection(str(self.socket))
        except OSError as exc:
            too_long = exc.errno is None and len(os.fsencode(self.socket)) > _SUN_PATH
            if exc.errno in _NOT_THERE or too_long:
                reason = exc.strerror or str(exc)
                raise DaemonUnavailableError(f"no daemon at {self.socket}: {reason}") from exc
            raise DaemonError(f"cannot reach the daemon at {self.socket}: {exc}") from exc
        except TimeoutError as exc:
            raise DaemonError(f"cannot reach the daemon at {self.socket}: timed out") from exc
        exchange = _Exchange(reader, writer)
        try:
            yield exchange
        finally:
            exchange.close()

    async def request(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        status, obj = await self._request(method, path, body)
        if status >= 400:
            raise _answer_error(obj, f"HTTP {status}")
        return status, obj

    async def _request(
        self, method: str, path: str, body: object, limit_s: float | None = None
    ) -> tuple[int, Any]:
        """The answer's status and JSON body, whatever the status."""
        payload = None if body is None else json.dumps(body).encode()
        async with self._exchange() as exchange:
            try:
                async with asyncio.timeout(limit_s or _REQUEST_TIMEOUT_S):
                    await exchange.send(method, path, payload)
                    data = await exchange.body()
            except (OSError, h11.ProtocolError, TimeoutError) as exc:
                raise DaemonError(f"the daemon at {self.socket} did not answer: {exc!r}") from exc
        status = exchange.status
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past reading
            raise DaemonError(f"the daemon answered {status} with a body that is not JSON") from exc
        return status, obj

    async def submit(self, request: JobRequest) -> tuple[Mapping[str, Any], bool]:
        status, info = await self.request("POST", "/v1/jobs", request.to_json())
        return _job(info), status == 201

    async def prepare(self, request: JobRequest) -> Prepared | None:
        status, answer = await self._request(
            "POST", "/v1/prepare", request.to_json(), _PREPARE_TIMEOUT_S
        )
        info = _error_info(answer)
        if status == 404 and info is not None and info.code == "not_found":
            return None  # a daemon from before the route
        if status >= 400:
            raise _answer_error(answer, f"HTTP {status}")
        return Prepared.from_json(answer)

    async def info(self, job_id: str) -> Mapping[str, Any]:
        return _job((await self.request("GET", f"/v1/jobs/{job_id}"))[1])

    async def cancel(self, job_id: str) -> Mapping[str, Any]:
        return _job((await self.request("DELETE", f"/v1/jobs/{job_id}"))[1])

    async def jobs(self) -> list[Mapping[str, Any]]:
        jobs = _object((await self.request("GET", "/v1/jobs"))[1], "job list").get("jobs")
        if not isinstance(jobs, list):
            raise DaemonError("the daemon answered a job list without its 'jobs'")
        return [_job(job) for job in jobs]

    async def status(self) -> dict[str, Any]:
        return _object((await self.request("GET", "/v1/status"))[1], "status")

    async def cache(self) -> dict[str, Any]:
        return _object((await self.request("GET", "/v1/cache"))[1], "cache summary")

    async def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]:
        target = f"/v1/jobs/{job_id}/events?{urlencode({'since': str(since)})}"
        async with self._exchange() as exchange:
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                    await exchange.send("GET", target, None)
                if exchange.status >= 400:
                    try:
                        body = json.loads(await exchange.body())
                    except (ValueError, RecursionError):
                        body = None
                    message = f"the daemon answered {exchange.status} for job {job_id}"
                    raise _answer_error(body, message)
                exchange.idle_s = _STREAM_IDLE_S  # the stream has no end to wait for
                async for line in _ndjson(exchange.chunks()):
                    event = parse_event(line)
                    if event is None:
                        continue  # a kind from a newer daemon: not ours to read
                    yield event
                    if isinstance(event, TERMINAL_EVENTS):
                        return
            except (OSError, h11.ProtocolError, TimeoutError) as exc:
                reason = str(exc) or type(exc).__name__
                raise DaemonError(
                    f"lost the daemon while following job {job_id} ({reason}); it may have "
                    "stopped or crashed: `shardsync status` tells, and the job resumes when it "
                    "is back"
                ) from exc
        raise DaemonError(f"the daemon closed the event stream of job {job_id} before it ended")


def _object(answer: object, what: str) -> dict[str, Any]:
    """An answer that must be a JSON object: anything else is a daemon breaking its API."""
    if not isinstance(answer, dict):
        raise DaemonError(f"the daemon answered a {what} that is not a JSON object")
    return answer


def _job(answer: object) -> dict[str, Any]:
    """A job's record: an object with a string ``id`` (what a handle on it needs)."""
    job = _object(answer, "job")
    if not isinstance(job.get("id"), str):
        raise DaemonError("the daemon answered a job without a string 'id'")
    return job


def _error_info(body: object) -> ErrorInfo | None:
    """What an error answer's body (``{"error": {"code", "message"}}``) says, if it is one."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return None
    return ErrorInfo(str(error.get("code", "")), str(error.get("message", "")))


def _answer_error(body: object, fallback: str) -> ShardsyncError:
    """The exception for an error answer's body."""
    info = _error_info(body)
    return DaemonError(fallback) if info is None else error_from(info)


async def _ndjson(chunks: AsyncIterator[bytes]) -> AsyncIterator[object]:
    """Values of a newline-delimited JSON body (no line-length limit below ``_MAX_LINE``)."""
    buffer = bytearray()
    async for chunk in chunks:
        buffer += chunk
        while (newline := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:newline])
            del buffer[: newline + 1]
            if line.strip():
                try:
                    value = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    raise DaemonError("the daemon sent a malformed event") from exc
                yield value
        if len(buffer) > _MAX_LINE:
            raise DaemonError("the daemon sent an event line larger than 64 MiB")


class DaemonLease:
    """A lease the daemon holds on a repo's snapshots in its cache for this process, for as
    long as this connection stays open (``release`` closes it). It also follows this
    process: it ends with it, ``kill -9`` included."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def release(self) -> None:
        """Stop protecting (the daemon lets go at its next heartbeat); idempotent."""
        self._sock.close()


def hold_lease(path: Path, request: JobRequest) -> DaemonLease | None:
    """Ask the daemon at ``path`` to lease ``request.source``'s snapshots in its cache
    (``POST /v1/leases``): blocking, so that any thread may hold and release it. None from a
    daemon older than that route."""
    body = json.dumps(request.to_json()).encode()
    conn = h11.Connection(h11.CLIENT)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(_REQUEST_TIMEOUT_S)
        sock.connect(str(path))
        headers = [("Host", "daemon"), ("Content-Type", "application/json")]
        headers.append(("Content-Length", str(len(body))))
        sock.sendall(conn.send(h11.Request(method="POST", target="/v1/leases", headers=headers)))
        sock.sendall(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        event = conn.next_event()
        while event is h11.NEED_DATA:
            conn.receive_data(sock.recv(1 << 16))
            event = conn.next_event()
        if not isinstance(event, h11.Response):
            raise DaemonError(f"the daemon at {path} answered a lease with {event!r}")
        if event.status_code == 201:
            sock.settimeout(None)
            return DaemonLease(sock)
    except (OSError, h11.ProtocolError) as exc:
        sock.close()
        raise DaemonError(f"the daemon at {path} did not lease: {exc!r}") from exc
    except BaseException:
        sock.close()
        raise
    sock.close()
    if event.status_code in (404, 405):
        return None  # a daemon from before the route
    raise DaemonError(f"the daemon at {path} answered {event.status_code} to a lease")
