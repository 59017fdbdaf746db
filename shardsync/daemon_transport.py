"""The client's side of the daemon's API: JSON over HTTP on the daemon's Unix socket.

``DaemonTransport`` sends the requests, turns an error answer (``{"error": {"code",
"message"}}``) into the project's exception for its code (``error_from``), and reads a job's
events from the NDJSON stream, one typed event a line (a kind this version does not know is
skipped) until the job ends. A socket nobody listens on is ``DaemonUnavailableError``; a
daemon that answers badly or goes away is ``DaemonError``.
"""

from __future__ import annotations

import errno
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import aiohttp

from shardsync.api import JobRequest, error_class
from shardsync.errors import DaemonError, DaemonUnavailableError, ShardsyncError
from shardsync.events import TERMINAL_EVENTS, ErrorInfo, JobEvent, parse_event

__all__ = ["DaemonTransport", "error_from"]

_BASE = "http://shardsync"
_MAX_LINE = 64 << 20
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=5)
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
_NOT_THERE = frozenset({errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.EACCES})


def error_from(error: ErrorInfo) -> ShardsyncError:
    """The exception for an API error object (``{"code", "message"}``)."""
    cls = error_class(error.code)
    if cls is None:
        return DaemonError(f"{error.message} ({error.code})" if error.code else error.message)
    return cls(error.message)


class DaemonTransport:
    """The daemon's JSON API over its Unix socket."""

    mode: Literal["daemon"] = "daemon"

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
            raise _answer_error(obj, f"HTTP {status}")
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

    async def jobs(self) -> list[Mapping[str, Any]]:
        return list((await self.request("GET", "/v1/jobs"))[1]["jobs"])

    async def status(self) -> dict[str, Any]:
        return dict((await self.request("GET", "/v1/status"))[1])

    async def cache(self) -> dict[str, Any]:
        return dict((await self.request("GET", "/v1/cache"))[1])

    async def events(self, job_id: str, since: int) -> AsyncIterator[JobEvent]:
        url = f"{_BASE}/v1/jobs/{job_id}/events"
        try:
            async with self._session.get(
                url, params={"since": str(since)}, timeout=_STREAM_TIMEOUT
            ) as resp:
                if resp.status >= 400:
                    try:
                        body = json.loads(await resp.read())
                    except ValueError:
                        body = None
                    raise _answer_error(body, f"the daemon answered {resp.status} for job {job_id}")
                async for line in _ndjson(resp):
                    event = parse_event(line)
                    if event is None:
                        continue  # a kind from a newer daemon: not ours to read
                    yield event
                    if isinstance(event, TERMINAL_EVENTS):
                        return
        except aiohttp.ClientError as exc:
            reason = str(exc) or type(exc).__name__
            raise DaemonError(
                f"lost the daemon while following job {job_id} ({reason}); it may have stopped "
                "or crashed: `shardsync status` tells, and the job resumes when it is back"
            ) from exc
        raise DaemonError(f"the daemon closed the event stream of job {job_id} before it ended")


def _answer_error(body: object, fallback: str) -> ShardsyncError:
    """The exception for an error answer's body (``{"error": {"code", "message"}}``)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return DaemonError(fallback)
    return error_from(ErrorInfo(str(error.get("code", "")), str(error.get("message", ""))))


async def _ndjson(resp: aiohttp.ClientResponse) -> AsyncIterator[object]:
    """Values of a newline-delimited JSON body (no line-length limit below ``_MAX_LINE``)."""
    buffer = bytearray()
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while (newline := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:newline])
            del buffer[: newline + 1]
            if line.strip():
                try:
                    value = json.loads(line)
                except ValueError as exc:
                    raise DaemonError("the daemon sent a malformed event") from exc
                yield value
        if len(buffer) > _MAX_LINE:
            raise DaemonError("the daemon sent an event line larger than 64 MiB")
