"""Hostile servers that throttle, storm, redirect across hosts or downgrade TLS.

Every case runs the real engine against real loopback servers and ends byte-exact or in
one clear shardsync error; nothing unverified is ever published. Backoff sleeps are
recorded by an injected ``sleep`` (the engine never really waits), except in the daemon,
whose policy is configured to wait only milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from email.utils import formatdate
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from daemons import api, cli, daemon_in_loop, short_tmp
from helpers import SleepRecorder, assert_store_verified, fast_config, serve_bytes, sha256_file

from shardsync.client import Client
from shardsync.config import Config
from shardsync.errors import TransferError
from shardsync.origins.http import PROBED_FILES
from shardsync.prefetch import prefetch
from shardsync.retry import RetryPolicy

SHARD_NAME = "model.safetensors"
SHARD = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + os.urandom(1 << 20)
FILES = {SHARD_NAME: SHARD, "config.json": b'{"model_type": "test"}'}
ETAG = '"v1"'
TOKEN = "hf_secret-token-for-the-origin-only"
POLICY = RetryPolicy(max_attempts=6, base_delay=0.001, max_delay=0.01, max_retry_after=30.0)
CONNECTIONS = 4
_SHARD_SHA = hashlib.sha256(SHARD).hexdigest()

Rule = Callable[[web.Request], web.StreamResponse | None]


@dataclass(frozen=True, slots=True)
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    headers: Mapping[str, str]


@dataclass
class Origin:
    """Serves ``FILES`` under any ``/{prefix}/`` with Range support; ``rule`` answers first.

    While ``hold`` is given and not yet set, every request waits for it (so a test can
    have several clients join a job before the origin says anything).
    """

    rule: Rule | None = None
    hold: asyncio.Event | None = None
    log: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.log.append(Seen(request.method, request.path, dict(request.headers)))
        if self.hold is not None:
            await self.hold.wait()
        if self.rule is not None:
            answer = self.rule(request)
            if answer is not None:
                return answer
        return _serve_file(request)

    def seen(self, method: str, name: str = SHARD_NAME) -> list[Seen]:
        return [s for s in self.log if s.method == method and s.path.endswith("/" + name)]


def _serve_file(request: web.Request) -> web.Response:
    data = FILES.get(request.match_info["name"])
    if data is None:
        return web.Response(status=404)
    return serve_bytes(request, data, ETAG)


class Servers:
    """Real aiohttp servers on loopback addresses, plain or TLS, closed by the fixture."""

    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []

    async def start(
        self, origin: Origin, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
    ) -> str:
        """Serve ``origin``; returns ``scheme://host:port`` (no trailing slash)."""
        app = web.Application()
        app.router.add_route("*", "/{prefix}/{name}", origin.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runners.append(runner)
        await web.TCPSite(runner, host, 0, ssl_context=tls).start()
        port = runner.addresses[0][1]
        return f"{'https' if tls else 'http'}://{host}:{port}"

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    running = Servers()
    try:
        yield running
    finally:
        await running.close()


def _config(cache: Path) -> Config:
    return fast_config(cache, connections_per_file=CONNECTIONS, retry=POLICY)


def _published_refs(cache: Path) -> list[Path]:
    return [p for p in cache.glob("*/*/refs/**/*") if p.is_file()]


def _shard_in_store(cache: Path) -> bool:
    return any(p.name == _SHARD_SHA for p in (cache / "store" / "sha256").glob("*/*"))


# ------------------------------------------------------------------------ 1. Retry-After


def _throttle(status: int, value: Callable[[], str], *, heads: int, gets: int) -> Rule:
    """The first ``heads`` HEADs and ``gets`` Range GETs of the shard answer ``status``."""
    left = {"HEAD": heads, "GET": gets}

    def rule(request: web.Request) -> web.StreamResponse | None:
        if request.match_info["name"] != SHARD_NAME or left.get(request.method, 0) <= 0:
            return None
        if request.method == "GET" and "Range" not in request.headers:
            return None
        left[request.method] -= 1
        return web.Response(status=status, headers={"Retry-After": value()}, text="slow down")

    return rule


def _http_date(offset: float) -> Callable[[], str]:
    return lambda: formatdate(time.time() + offset, usegmt=True)


def _const(text: str) -> Callable[[], str]:
    return lambda: text


CLAMPED = (POLICY.max_retry_after, POLICY.max_retry_after)
BACKOFF = (0.0, POLICY.max_delay)  # garbage or "now": the ordinary jittered backoff
RETRY_AFTER: list[tuple[str, Callable[[], str], tuple[float, float]]] = [
    ("seconds", _const("5"), (5.0, 5.0)),
    ("huge", _const("999999999"), CLAMPED),
    ("huge-digit-run", _const("9" * 400), CLAMPED),
    ("negative", _const("-5"), BACKOFF),
    ("date-past", _http_date(-3600), BACKOFF),
    ("date-epoch", _const("Thu, 01 Jan 1970 00:00:00 GMT"), BACKOFF),
    # a date carries whole seconds, so it is honoured to within a second (plus slack)
    ("date-future", _http_date(20), (15.0, 20.0)),
    ("date-far-future", _http_date(3600), CLAMPED),
    ("date-year-9999", _const("Fri, 31 Dec 9999 23:59:59 GMT"), CLAMPED),
    ("garbage-soon", _const("soon"), BACKOFF),
    ("garbage-1e400", _const("1e400"), BACKOFF),
    ("garbage-NaN", _const("NaN"), BACKOFF),
    ("garbage-inf", _const("inf"), BACKOFF),
    ("garbage-empty", _const(""), BACKOFF),
    ("garbage-plus", _const("+5"), BACKOFF),
    ("garbage-feb-31", _const("Tue, 31 Feb 2026 00:00:00 GMT"), BACKOFF),
    ("garbage-year-99999", _const("Mon, 01 Jan 99999 00:00:00 GMT"), BACKOFF),
]


@pytest.mark.parametrize("status", [429, 503])
@pytest.mark.parametrize(
    ("value", "expected"),
    [(v, e) for _, v, e in RETRY_AFTER],
    ids=[name for name, _, _ in RETRY_AFTER],
)
async def test_retry_after_is_clamped_or_ignored_and_the_download_completes(
    servers: Servers,
    tmp_path: Path,
    status: int,
    value: Callable[[], str],
    expected: tuple[float, float],
) -> None:
    origin = Origin(rule=_throttle(status, value, heads=2, gets=2))
    base = await servers.start(origin)
    sleep = SleepRecorder()
    result = await prefetch(f"{base}/ckpt/", _config(tmp_path), sleep=sleep)
    assert (result.snapshot_path / SHARD_NAME).read_bytes() == SHARD
    assert_store_verified(tmp_path, FILES)
    # two refused HEADs (origin probe) and two refused Range GETs: one sleep each, no more
    assert len(sleep.delays) == 4, sleep.delays
    low, high = expected
    assert all(low <= d <= high for d in sleep.delays), sleep.delays
    assert result.fetch is not None and dict(result.fetch.retries) == {f"http_{status}": 4}


# ------------------------------------------------------------------------ 2. 5xx storm


def _storm(where: str) -> Rule:
    """503 forever, with a Retry-After that must be clamped, not obeyed."""

    def rule(request: web.Request) -> web.StreamResponse | None:
        if request.match_info["prefix"] != "ckpt":
            return None
        if where == "data" and not (
            request.match_info["name"] == SHARD_NAME and "Range" in request.headers
        ):
            return None
        return web.Response(status=503, headers={"Retry-After": "999999999"}, text="overloaded")

    return rule


@pytest.mark.parametrize("where", ["everything", "data"])
async def test_a_503_storm_gives_up_after_a_bounded_number_of_attempts(
    servers: Servers, tmp_path: Path, where: str
) -> None:
    origin = Origin(rule=_storm(where))
    base = await servers.start(origin)
    sleep = SleepRecorder()
    with pytest.raises(TransferError, match=r"giving up after 6 attempts, last error: .*HTTP 503"):
        await prefetch(f"{base}/ckpt/", _config(tmp_path), sleep=sleep)

    attempts = POLICY.max_attempts
    if where == "everything":
        refused = [s for s in origin.log if s.method == "HEAD"]
        per_file = {s.path: 0 for s in refused}
        for s in refused:
            per_file[s.path] += 1
        assert max(per_file.values()) == attempts  # the file that gave up
        assert len(refused) <= len(PROBED_FILES) * attempts
        assert not origin.seen("GET")
        most_sleeps = len(PROBED_FILES) * (attempts - 1)
    else:
        refused = origin.seen("GET")
        assert attempts <= len(refused) <= CONNECTIONS * attempts
        most_sleeps = CONNECTIONS * (attempts - 1)
    # every wait was the server's absurd Retry-After, clamped; in all, a bounded wait
    assert sleep.delays and set(sleep.delays) == {POLICY.max_retry_after}
    assert len(sleep.delays) <= most_sleeps
    assert sum(sleep.delays) <= most_sleeps * POLICY.max_retry_after
    assert_store_verified(tmp_path, FILES)
    assert not _shard_in_store(tmp_path)
    assert _published_refs(tmp_path) == []


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_tmp() as path:
        yield path


async def test_a_503_storm_through_the_daemon_fails_every_waiting_client(
    servers: Servers, workdir: Path
) -> None:
    hold = asyncio.Event()
    origin = Origin(rule=_storm("everything"), hold=hold)
    base = await servers.start(origin)
    stormy, healthy = f"{base}/ckpt/", f"{base}/good/"
    # the daemon really sleeps: make every wait (Retry-After included) a few milliseconds
    fast = replace(POLICY, max_retry_after=0.005)
    config = fast_config(workdir / "cache", connections_per_file=CONNECTIONS, retry=fast)
    async with (
        daemon_in_loop(config, workdir / "shardsync" / "d.sock") as daemon,
        Client(socket=daemon.socket_path, fallback="error") as first,
        Client(socket=daemon.socket_path, fallback="error") as second,
    ):
        assert first.mode == second.mode == "daemon"
        started = await first.prefetch(stormy)
        joined = await second.prefetch(stormy)  # the origin holds every answer meanwhile
        assert started.created and not joined.created and joined.id == started.id
        hold.set()
        outcomes = await asyncio.gather(started.wait(), joined.wait(), return_exceptions=True)
        for outcome in outcomes:
            assert type(outcome) is TransferError, outcome
            assert "giving up after 6 attempts" in str(outcome) and "HTTP 503" in str(outcome)

        status, info = await api(daemon.socket_path, "GET", f"/v1/jobs/{started.id}")
        assert status == 200 and info["state"] == "failed"
        assert info["error"]["code"] == "transfer" and "HTTP 503" in info["error"]["message"]
        per_file: dict[str, int] = {}
        for s in origin.log:
            per_file[s.path] = per_file.get(s.path, 0) + 1
        assert max(per_file.values()) == fast.max_attempts
        assert len(origin.log) <= len(PROBED_FILES) * fast.max_attempts

        # the daemon is unharmed: the next job, from a healthy base, completes byte-exact
        result = await (await second.prefetch(healthy)).wait()
        assert (result.snapshot_path / SHARD_NAME).read_bytes() == SHARD
        status, daemon_status = await api(daemon.socket_path, "GET", "/v1/status")
        assert status == 200 and daemon_status["jobs"]["failed"] == 1
        assert daemon_status["jobs"]["done"] == 1
    assert_store_verified(workdir / "cache", FILES)


# ------------------------------------------------------------------------ 3. cross-host redirect


def _redirect(target: str, status: int) -> Rule:
    """The shard (HEAD and GET) lives at ``target``/blobs/; everything else is served here."""

    def rule(request: web.Request) -> web.StreamResponse | None:
        if request.match_info["name"] != SHARD_NAME:
            return None
        return web.Response(status=status, headers={"Location": f"{target}/blobs/{SHARD_NAME}"})

    return rule


@pytest.mark.parametrize(
    ("host", "status"),
    [("127.0.0.2", 302), ("127.0.0.1", 307)],
    ids=["other-host-and-port", "same-host-other-port"],
)
async def test_the_token_never_follows_a_redirect_to_another_host(
    servers: Servers, tmp_path: Path, host: str, status: int
) -> None:
    data_server = Origin()
    target = await servers.start(data_server, host=host)
    origin = Origin()
    base = await servers.start(origin)
    origin.rule = _redirect(target, status)
    assert target.rsplit(":", 1)[1] != base.rsplit(":", 1)[1]

    result = await prefetch(f"{base}/ckpt/", _config(tmp_path), token=TOKEN)
    assert (result.snapshot_path / SHARD_NAME).read_bytes() == SHARD
    assert_store_verified(tmp_path, FILES)
    # the origin got the token on every request, including the ones it redirected
    assert origin.seen("HEAD") and origin.seen("HEAD", "config.json")
    assert all(s.headers.get("Authorization") == f"Bearer {TOKEN}" for s in origin.log)
    # the other server served the shard, and never saw the token in any form
    assert data_server.seen("GET")
    assert {s.path for s in data_server.log} == {f"/blobs/{SHARD_NAME}"}
    for seen in data_server.log:
        assert "Authorization" not in seen.headers and "Cookie" not in seen.headers
        assert not any(TOKEN in value for value in seen.headers.values())


# ------------------------------------------------------------------------ 4. TLS downgrade


@dataclass(frozen=True, slots=True)
class Tls:
    """A private CA and a server context holding a certificate it issued for 127.0.0.1."""

    server: ssl.SSLContext
    ca_file: Path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    ca_file = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return Tls(server=server, ca_file=ca_file)


async def _cli_prefetch(
    url: str, cache: Path, env: Mapping[str, str]
) -> tuple[int, str, dict[str, object] | None]:
    """``shardsync prefetch URL`` in a child process (its trust store comes from ``env``).

    Fast retries, so a regression that made a refusal retryable fails quickly instead of
    hanging. The test's loop keeps serving while the child runs.
    """
    config = cache.parent / f"{cache.name}.toml"
    config.write_text("[retry]\nmax_attempts = 3\nbase_delay = 0.01\nmax_delay = 0.05\n")
    args = ["--config", str(config), "prefetch", url, "--no-daemon", "--quiet", "--json"]
    done = await asyncio.to_thread(cli, *args, "--cache-dir", str(cache), env=env)
    answer = json.loads(done.stdout) if done.returncode == 0 else None
    return done.returncode, done.stderr, answer


async def test_https_to_https_on_another_port_works_with_the_ca_trusted(
    servers: Servers, tmp_path: Path, tls: Tls
) -> None:
    data_server = Origin()
    target = await servers.start(data_server, tls=tls.server)
    origin = Origin()
    base = await servers.start(origin, tls=tls.server)
    origin.rule = _redirect(target, 302)
    url = f"{base}/ckpt/"

    # without our CA the child refuses the certificate: verification is really on
    code, stderr, _ = await _cli_prefetch(url, tmp_path / "untrusted", {"SSL_CERT_FILE": ""})
    assert code == 6 and "certificate verify failed" in stderr, stderr
    assert origin.log == [] and data_server.log == []

    cache = tmp_path / "trusted"
    code, stderr, answer = await _cli_prefetch(url, cache, {"SSL_CERT_FILE": str(tls.ca_file)})
    assert code == 0, stderr
    assert answer is not None and isinstance(answer["snapshot_path"], str)
    shard = Path(answer["snapshot_path"]) / SHARD_NAME
    assert sha256_file(shard) == _SHARD_SHA and shard.read_bytes() == SHARD
    assert origin.seen("HEAD") and data_server.seen("GET")
    assert_store_verified(cache, FILES)


async def test_https_to_http_redirect_is_refused_before_any_plain_request(
    servers: Servers, tmp_path: Path, tls: Tls
) -> None:
    plain = Origin()
    target = await servers.start(plain)
    origin = Origin()
    base = await servers.start(origin, tls=tls.server)
    origin.rule = _redirect(target, 302)

    cache = tmp_path / "cache"
    code, stderr, _ = await _cli_prefetch(
        f"{base}/ckpt/", cache, {"SSL_CERT_FILE": str(tls.ca_file)}
    )
    assert code == 6, stderr  # ProtocolError's exit code
    assert f"refusing https -> http redirect to {target}/blobs/{SHARD_NAME}" in stderr, stderr
    assert "Traceback" not in stderr
    assert origin.seen("HEAD")  # the TLS origin was reached and answered the redirect
    assert plain.log == []  # not one byte went over plain HTTP
    assert_store_verified(cache, FILES)
    assert not _shard_in_store(cache)
    assert _published_refs(cache) == []
