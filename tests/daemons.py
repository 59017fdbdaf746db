"""Daemons for tests: one in the test's event loop, its raw API, and the CLI as a user runs it.

A real daemon process (``DaemonProcess``, ready when it says ``READY=1`` on a notify socket,
and ``write_config`` for it) is in ``shardsync.testing.daemons``: the benchmarks use it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from shardsync.config import Config, DaemonConfig
from shardsync.daemon import Daemon


@contextlib.contextmanager
def short_tmp() -> Iterator[Path]:
    """A directory with a short path (AF_UNIX paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def daemon_in_loop(config: Config, socket_path: Path, **daemon: Any) -> AsyncIterator[Daemon]:
    """A ``Daemon`` serving from the test's own event loop."""
    config = replace(config, daemon=DaemonConfig(socket=socket_path, **daemon))
    running = Daemon(config, environ={})
    serving = asyncio.create_task(running.serve())
    ready = asyncio.create_task(running.wait_ready())
    await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        serving.result()
    try:
        yield running
    finally:
        running.request_stop()
        await serving


async def api(
    socket_path: Path,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    json_body: object = None,
) -> tuple[int, Any]:
    """One raw request to the daemon's Unix socket: (status, parsed JSON or text)."""
    connector = aiohttp.UnixConnector(path=str(socket_path))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.request(method, "http://daemon" + path, data=body, json=json_body) as resp,
    ):
        text = await resp.text()
        if resp.content_type == "application/json":
            return resp.status, json.loads(text)
        return resp.status, text


def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``shardsync ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "shardsync.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
