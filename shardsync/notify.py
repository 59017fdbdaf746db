"""sd_notify(3) without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

systemd's ``Type=notify`` services say ``READY=1`` once they serve, ``STATUS=...`` to show a
line in ``systemctl status``, ``RELOADING=1`` around a config reload and ``STOPPING=1`` when
they begin to shut down. The protocol is a single ``AF_UNIX`` datagram of ``KEY=VALUE`` lines
to the socket named by ``$NOTIFY_SOCKET``: a path, or an abstract name written with a leading
``@``. Outside systemd the variable is unset and every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger("shardsync.notify")


class Notifier:
    """Sends state changes to the service manager, if there is one."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, *, wait: float = 1.0, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines (``send(READY=1, STATUS="serving")``); False if not sent.

        A failure is logged, never raised: the daemon's work does not depend on the manager.
        A manager that reads nothing (PID 1 busy; its queue holds 10 datagrams) holds the
        send at most ``wait`` seconds: it runs on the event loop, which a blocking send froze,
        signal handlers and all.
        """
        if not self._address:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(wait)
                sock.connect(self._address)
                sock.sendall(message)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self._address.replace("\0", "@"), exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        """A status line, sent at every job's start and end: dropped rather than waited for."""
        return self.send(wait=0.0, STATUS=status)

    def reloading(self) -> bool:
        """``RELOADING=1`` with the timestamp newer systemd (``Type=notify-reload``) expects."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send(RELOADING=1, MONOTONIC_USEC=usec)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)
