"""Loopback ports for the real servers the tests and the benchmarks start (nginx, squid,
vLLM's OpenAI server): a free one, and waiting until a started server listens on it."""

from __future__ import annotations

import socket
import subprocess
import time

__all__ = ["free_port", "wait_listening"]


def free_port() -> int:
    """A port nothing listens on now (the server binds it a moment later: good enough on
    loopback, where nothing else races for it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(
    port: int, process: subprocess.Popen[bytes], timeout: float, *, every: float = 0.05
) -> bool:
    """Whether ``127.0.0.1:port`` accepts a connection before ``process`` exits or
    ``timeout`` seconds pass; the caller says what failed (its own log, its own error)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(every)
