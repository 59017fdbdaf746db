"""A real ``shardsync daemon`` process, ready when it says so on an sd_notify socket.

A daemon process is ready when it says ``READY=1`` on the notify socket the caller binds,
exactly as under systemd, so nothing polls a socket file or sleeps. The tests and
``bench/kill.py`` start theirs with it; ``tests/daemons.py`` has the in-loop daemon.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path


def write_config(
    path: Path, *, cache: Path, endpoint: str, socket_path: Path, daemon: str = ""
) -> Path:
    """A config for a daemon process: fast retries, small chunks, frequent resume records."""
    path.write_text(
        f'[cache]\ndir = "{cache}"\n[hub]\nendpoint = "{endpoint}"\n'
        '[download]\nconnections_per_file = 2\nchunk_size = "1MiB"\nwrite_size = "64KiB"\n'
        'read_size = "64KiB"\nsidecar_interval = 0.05\n'
        "[retry]\nbase_delay = 0.01\nmax_delay = 0.1\n"
        f'[daemon]\nsocket = "{socket_path}"\n{daemon}'
    )
    return path


class DaemonProcess:
    """``shardsync daemon`` in its own process, with a notify socket bound by the caller."""

    def __init__(
        self,
        config: Path,
        workdir: Path,
        env: Mapping[str, str] | None = None,
        *,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        """``preexec`` runs in the child before the daemon starts (a seccomp filter, as a
        unit's ``SystemCallFilter=`` installs)."""
        self.config = config
        self.preexec = preexec
        self.notify_path = workdir / f"notify-{os.getpid()}-{id(self)}"
        self.log_path = workdir / f"daemon-{id(self)}.log"
        self.env = dict(env or {})
        self.proc: subprocess.Popen[str] | None = None
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._notify.bind(str(self.notify_path))
        self._notify.settimeout(0.2)

    def start(self) -> dict[str, str]:
        """Start and wait for ``READY=1``; returns that message's fields."""
        env = {**os.environ, **self.env, "NOTIFY_SOCKET": str(self.notify_path)}
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shardsync.cli", "daemon", "--config", str(self.config)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                preexec_fn=self.preexec,
            )
        return self.wait_for("READY")

    def wait_for(self, key: str) -> dict[str, str]:
        """The next notify message that has ``key`` (earlier ones are skipped)."""
        deadline = time.monotonic() + 60
        while True:
            try:
                data = self._notify.recv(4096)
            except TimeoutError:
                ended = None if self.proc is None else self.proc.poll()
                if ended is None and time.monotonic() < deadline:
                    continue
                raise AssertionError(
                    f"no {key}= from the daemon (exit status {ended}): {self.output()}"
                ) from None
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
            if key in fields:
                return fields

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 10) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def output(self) -> str:
        """What the daemon logged so far."""
        return self.log_path.read_text() if self.log_path.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._notify.close()
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
