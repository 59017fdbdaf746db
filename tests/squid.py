"""A real squid forward proxy on loopback, for the proxy tests (one per test session).

It never resolves a name outside (``dns_nameservers 127.0.0.1``), caches nothing, allows
requests and CONNECT tunnels from loopback to any port, and logs one line per request with
the method, URL and status, so a test can tell what went through it. With ``auth=(user,
password)`` it asks for them (basic auth, squid's own ``basic_ncsa_auth`` over an htpasswd
file) and answers 407 to every request without them, as a corporate proxy does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardsync.testing.ports import free_port, wait_listening

SQUID = shutil.which("squid") or ("/usr/sbin/squid" if Path("/usr/sbin/squid").exists() else None)
NCSA_AUTH = Path("/usr/lib/squid/basic_ncsa_auth")


class SquidUnavailable(RuntimeError):
    """squid is missing or did not start; the fixture turns this into a skip."""


@dataclass(frozen=True, slots=True)
class Squid:
    url: str  # http://127.0.0.1:PORT
    work: Path

    def log(self) -> list[tuple[str, str, int]]:
        """(method, URL, status) of every request squid has finished, oldest first."""
        path = self.work / "access.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            method, url, status = line.split(" ")[:3]
            out.append((method, url, int(status)))
        return out

    def mark(self) -> int:
        """How many lines the log has now: pass to ``log_since``."""
        return len(self.log())

    def log_since(self, mark: int) -> list[tuple[str, str, int]]:
        # squid writes its log line when a request ends; give it a moment to flush
        time.sleep(0.3)
        return self.log()[mark:]


@contextlib.contextmanager
def run_squid(timeout: float = 20.0, *, auth: tuple[str, str] | None = None) -> Iterator[Squid]:
    """Start squid in a fresh directory under /tmp: as root squid runs as ``proxy``, which
    must reach its files (pytest's own temp folders are 0700)."""
    if SQUID is None:
        raise SquidUnavailable("squid is not installed (apt-get install squid)")
    if auth is not None and not NCSA_AUTH.exists():
        raise SquidUnavailable(f"squid's {NCSA_AUTH.name} helper is not installed")
    work = Path(tempfile.mkdtemp(prefix="shardsync-squid-", dir="/tmp"))
    try:
        with _squid_in(work, timeout, auth) as running:
            yield running
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _squid_in(work: Path, timeout: float, auth: tuple[str, str] | None) -> Iterator[Squid]:
    assert SQUID is not None
    work.chmod(0o755)
    port = free_port()
    conf = work / "squid.conf"
    access = "http_access allow loopback"
    if auth is not None:
        user, password = auth
        hashed = subprocess.run(
            ["openssl", "passwd", "-apr1", password], capture_output=True, text=True, check=True
        ).stdout.strip()
        (work / "htpasswd").write_text(f"{user}:{hashed}\n")
        (work / "htpasswd").chmod(0o644)
        access = (
            f"auth_param basic program {NCSA_AUTH} {work}/htpasswd\n"
            "auth_param basic realm shardsync-test\n"
            "acl authed proxy_auth REQUIRED\n"
            "http_access allow loopback authed"
        )
    conf.write_text(
        f"""http_port 127.0.0.1:{port}
pid_filename {work}/squid.pid
cache_log {work}/cache.log
logformat brief %rm %ru %>Hs %<st
access_log stdio:{work}/access.log logformat=brief
buffered_logs off
cache deny all
cache_mem 4 MB
dns_nameservers 127.0.0.1
acl loopback src 127.0.0.0/8
{access}
http_access deny all
coredump_dir {work}
shutdown_lifetime 0 seconds
max_filedescriptors 1024
forwarded_for delete
via off
strip_query_terms off
"""
    )
    if os.geteuid() == 0:  # squid drops to its own user: it must write its files here
        shutil.chown(work, user="proxy", group="proxy")
    proc = subprocess.Popen(
        [SQUID, "-N", "-f", str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        if not wait_listening(port, proc, timeout, every=0.1):
            err = proc.stderr.read().decode() if proc.stderr and proc.poll() is not None else ""
            log = (work / "cache.log").read_text() if (work / "cache.log").exists() else ""
            raise SquidUnavailable(f"squid did not start: {err[-800:]} {log[-800:]}")
        yield Squid(url=f"http://127.0.0.1:{port}", work=work)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()
