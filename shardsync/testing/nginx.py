"""A real nginx serving a directory on loopback, for the plain-HTTP origin tests.

    with serve_directory(checkpoint.directory, tmp_path / "nginx") as base:
        ...  # base is http://127.0.0.1:PORT/, access_log(work) the requests it served

`NginxUnavailable` says the binary is missing (the tests mark such tests ``nginx``, and
skip them when `find_nginx` finds none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shardsync.testing.ports import free_port, wait_listening

START_TIMEOUT_S = 10.0


class NginxUnavailable(RuntimeError):
    """nginx is not installed."""


def find_nginx() -> str | None:
    """The nginx binary: on PATH, else ``/usr/sbin/nginx`` (not on a user's PATH)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


@contextmanager
def serve_directory(root: Path, work: Path) -> Iterator[str]:
    """Run nginx in the foreground on a free loopback port; yields the base URL."""
    with run_nginx(work, f"root {root};") as url:
        yield url + "/"


@contextmanager
def run_nginx(
    work: Path, server: str, *, http: str = "", log_format: str | None = None, workers: int = 1
) -> Iterator[str]:
    """nginx in the foreground on a free loopback port with ``server`` as the body of its one
    ``server`` block; yields ``http://127.0.0.1:PORT``. ``http``: more directives for the
    ``http`` block (``sendfile on;``); ``log_format``: the access log's format (nginx's
    ``combined`` without one). Its pid is in ``work/nginx.pid``.

    Raises `NginxUnavailable` when nginx is not installed, `RuntimeError` when it does not
    start within `START_TIMEOUT_S`."""
    nginx = find_nginx()
    if nginx is None:
        raise NginxUnavailable("nginx is not installed (apt-get install nginx)")
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    logging = f"log_format ours '{log_format}';\n    access_log {work}/access.log ours;"
    if log_format is None:
        logging = f"access_log {work}/access.log;"
    conf = work / "nginx.conf"
    conf.write_text(
        f"""{user}daemon off;
worker_processes {workers};
pid {work}/nginx.pid;
error_log {work}/error.log;
events {{ worker_connections 1024; }}
http {{
    {logging}
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    fastcgi_temp_path {work}/fastcgi;
    uwsgi_temp_path {work}/uwsgi;
    scgi_temp_path {work}/scgi;
    types {{ application/json json; }}
    default_type application/octet-stream;
    {http}
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
        start_new_session=True,
    )
    try:
        if not wait_listening(port, proc, START_TIMEOUT_S):
            err = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
            raise RuntimeError(f"nginx did not start: {err}")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def access_log(work: Path) -> list[str]:
    """The lines of the access log of the nginx that ran in ``work``."""
    return (work / "access.log").read_text().splitlines()
