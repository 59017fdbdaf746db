"""A real nginx serving a directory on loopback, for the plain-HTTP origin tests.

    with serve_directory(checkpoint.directory, tmp_path / "nginx") as base:
        ...  # base is http://127.0.0.1:PORT/, access_log(work) the requests it served

`NginxUnavailable` says the binary is missing (the tests mark such tests ``nginx``, and
skip them when `find_nginx` finds none).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 10.0


class NginxUnavailable(RuntimeError):
    """nginx is not installed."""


def find_nginx() -> str | None:
    """The nginx binary: on PATH, else ``/usr/sbin/nginx`` (not on a user's PATH)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_directory(root: Path, work: Path) -> Iterator[str]:
    """Run nginx in the foreground on a free loopback port; yields the base URL."""
    with run_nginx(work, f"root {root};") as url:
        yield url + "/"


@contextmanager
def run_nginx(work: Path, server: str) -> Iterator[str]:
    """nginx in the foreground on a free loopback port with ``server`` as the body of its one
    ``server`` block; yields ``http://127.0.0.1:PORT``.

    Raises `NginxUnavailable` when nginx is not installed, `RuntimeError` when it does not
    start within `START_TIMEOUT_S`."""
    nginx = find_nginx()
    if nginx is None:
        raise NginxUnavailable("nginx is not installed (apt-get install nginx)")
    port = _free_port()
    work.mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = work / "nginx.conf"
    conf.write_text(
        f"""{user}daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log {work}/access.log;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    types {{ application/json json; }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        {server}
    }}
}}
"""
    )
    proc = subprocess.Popen(
        [nginx, "-c", str(conf), "-p", str(work)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(f"nginx did not start: {err}") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


def access_log(work: Path) -> list[str]:
    """The lines of the access log of the nginx that ran in ``work``."""
    return (work / "access.log").read_text().splitlines()
