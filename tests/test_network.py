"""Proxies, NO_PROXY, private CAs and mirrors: the parsing rules, then real squid and nginx.

A squid test is a squid test: it shows what goes through a standard forward proxy (plain
requests and CONNECT tunnels), which is how Dragonfly's dfdaemon is used too, but it is not
a Dragonfly test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pytest
import trustme
from aiohttp import web
from helpers import assert_snapshot_matches, assert_store_verified, fast_config
from squid import Squid, SquidUnavailable, run_squid

from shardsync.config import Config, S3Config, load_config
from shardsync.errors import (
    AuthError,
    ConfigError,
    IntegrityError,
    ManifestError,
    TransferError,
)
from shardsync.network import NetworkConfig, NoProxy, Proxy, network_from_env, ssl_context
from shardsync.prefetch import prefetch
from shardsync.testing import Checkpoint, FakeHub, FlipByte
from shardsync.testing.nginx import run_nginx
from shardsync.testing.relay import Relay
from shardsync.testing.seaweedfs import S3Server

REPO = "acme/net"

# ------------------------------------------------------------------------------ rules


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "bypass"),
    [
        ("", "example.com", 443, False),
        ("*", "anything.internal", 80, True),
        ("example.com", "example.com", 443, True),
        ("example.com", "cdn.example.com", 443, True),
        ("example.com", "badexample.com", 443, False),
        (".example.com", "cdn.example.com", 443, True),
        (".example.com", "example.com", 443, True),
        ("EXAMPLE.com", "Cdn.Example.COM", 443, True),
        (" a.org , example.com ", "x.example.com", 80, True),
        ("example.com:8080", "example.com", 8080, True),
        ("example.com:8080", "example.com", 443, False),
        ("10.0.0.0/8", "10.1.2.3", 80, True),
        ("10.0.0.0/8", "11.1.2.3", 80, False),
        ("127.0.0.1", "127.0.0.1", 9000, True),
        ("127.0.0.1", "127.0.0.2", 9000, False),
        ("::1", "::1", 80, True),
        ("fd00::/8", "fd12::5", 80, True),
        ("[::1]:8080", "::1", 8080, True),
        ("localhost", "localhost.", 80, True),
        ("example.com:\u00b2", "example.com", 443, False),  # no port: "\u00b2" is no digit
        ("[::1]:\u00b2", "::1", 80, True),  # a bracketed host's port that is no number: none
    ],
)
def test_no_proxy_matches_like_curl(no_proxy: str, host: str, port: int, bypass: bool) -> None:
    assert NoProxy.parse(no_proxy).bypass(host, port) is bypass


def test_the_proxy_for_each_scheme_and_the_precedence_of_the_variables() -> None:
    env = {
        "HTTP_PROXY": "http://upper:3128",
        "http_proxy": "http://lower:3128",
        "ALL_PROXY": "http://all:3128",
        "NO_PROXY": "internal.example",
    }
    net = network_from_env(env)
    assert net.proxy_for("http://hub.example/x") == Proxy("http://lower:3128")
    assert net.proxy_for("https://hub.example/x") == Proxy("http://all:3128")  # fallback
    assert net.proxy_for("https://s3.internal.example/x") is None
    # [network] wins over every variable
    forced = network_from_env(env, proxy="http://cfg:8080", no_proxy="")
    assert forced.proxy_for("https://s3.internal.example/") == Proxy("http://cfg:8080")
    assert network_from_env(env, proxy="").proxy_for("http://hub.example/") is None
    assert network_from_env({}).proxy_for("https://huggingface.co/") is None


def test_proxy_credentials_are_split_off_and_never_shown() -> None:
    proxy = Proxy.parse("http://al%40ice:s3cr%3At@proxy.corp:3128", source="HTTPS_PROXY")
    assert (proxy.url, proxy.username, proxy.password) == (
        "http://proxy.corp:3128",
        "al@ice",
        "s3cr:t",
    )
    assert "s3cr" not in repr(proxy) and "s3cr" not in proxy.redacted
    assert Proxy.parse("proxy.corp:3128", source="x").url == "http://proxy.corp:3128"


@pytest.mark.parametrize(
    "text",
    [
        "http://alice:Tr0ub4dor/x?y@proxy.corp:3128",  # no port: the error names the URL
        "http://alice:1234/x@proxy.corp:3128",  # a "port": a proxy named alice, silently
        "http://alice:pa#ss@proxy.corp:3128",
    ],
)
def test_a_proxy_password_not_percent_encoded_is_refused_and_never_shown(text: str) -> None:
    """A '/', '?' or '#' in the password ends the userinfo for ``urlsplit``: the rest was
    echoed in the error (stderr, the daemon's journal), or a numeric password made a proxy
    of the user name. Refused, with the password nowhere in the message."""
    with pytest.raises(ConfigError) as caught:
        Proxy.parse(text, source="HTTPS_PROXY")
    assert "Tr0ub" not in str(caught.value) and "pa#" not in str(caught.value)
    assert "x@proxy" not in str(caught.value)
    assert "proxy.corp:3128" in str(caught.value)


@pytest.mark.parametrize("bad", ["socks5://p:1080", "http://", "http://p:notaport"])
def test_unusable_proxy_urls_name_their_source(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        network_from_env({"HTTPS_PROXY": bad})
    assert "HTTPS_PROXY" in str(caught.value)


def test_ca_bundle_from_config_then_ssl_cert_file_then_requests(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in ("a.pem", "b.pem", "c.pem"))
    for f in (a, b, c):
        f.write_text("x")
    env = {"SSL_CERT_FILE": str(b), "REQUESTS_CA_BUNDLE": str(c)}
    assert network_from_env(env, ca_bundle=str(a)).ca_bundle == a
    assert network_from_env(env).ca_bundle == b
    assert network_from_env({"REQUESTS_CA_BUNDLE": str(c)}).ca_bundle == c
    assert network_from_env({}).ca_bundle is None
    with pytest.raises(ConfigError) as caught:
        network_from_env({"SSL_CERT_FILE": str(tmp_path / "missing.pem")})
    assert "SSL_CERT_FILE" in str(caught.value)


def test_network_section_of_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "c.toml"
    conf.write_text(
        '[network]\nproxy = "http://p:1"\nno_proxy = "10.0.0.0/8"\nmetadata_timeout = 600\n'
        '[network.headers."*.hf.co"]\nX-Dragonfly-Tag = "models"\n'
    )
    net = load_config(conf, {"HOME": str(tmp_path)}).network
    assert net.proxy_for("https://cas-bridge.xethub.hf.co/x") == Proxy("http://p:1")
    assert net.proxy_for("http://10.2.3.4/x") is None
    assert net.metadata_timeout == 600
    assert net.extra_headers("https://cdn-lfs.hf.co/a") == {"X-Dragonfly-Tag": "models"}
    assert net.extra_headers("https://huggingface.co/a") == {}
    conf.write_text('[network.headers."x"]\n"Bad Header" = "v"\n')
    with pytest.raises(ConfigError):
        load_config(conf, {"HOME": str(tmp_path)})


# ------------------------------------------------------------------------------ squid


@pytest.fixture(scope="module")
def squid() -> Iterator[Squid]:
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(run_squid())
        except SquidUnavailable as exc:
            pytest.skip(str(exc))
        yield running


SQUID_USER = ("alice", "s3cret:with@odd/chars")


@pytest.fixture(scope="module")
def authed_squid() -> Iterator[Squid]:
    """squid asking for basic-auth credentials (407 without them)."""
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(run_squid(auth=SQUID_USER))
        except SquidUnavailable as exc:
            pytest.skip(str(exc))
        yield running


def authed(squid: Squid, user: str, password: str) -> str:
    """The proxy URL with the credentials in it, percent-coded as a user writes them."""
    userinfo = f"{quote(user, safe='')}:{quote(password, safe='')}"
    return squid.url.replace("://", f"://{userinfo}@", 1)


@pytest.fixture
async def hub(checkpoint: Checkpoint) -> AsyncIterator[FakeHub]:
    async with FakeHub() as fake:
        fake.add_checkpoint(REPO, checkpoint)
        yield fake


def assert_same_files(snapshot: Path, checkpoint: Checkpoint) -> None:
    """A plain-URL snapshot: every shard, and each file it holds byte for byte the origin's."""
    held = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}
    assert set(checkpoint.shards) <= held
    for rel in held:
        assert (snapshot / rel).read_bytes() == checkpoint.path(rel).read_bytes(), rel


def through(config: Config, env: dict[str, str]) -> Config:
    return replace(config, network=network_from_env(env))


async def test_hub_and_cdn_requests_go_through_the_proxy(
    squid: Squid, hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    config = through(fast_config(tmp_path / "c", hub.endpoint), {"http_proxy": squid.url})
    mark = squid.mark()
    result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    assert_store_verified(config.cache_dir, checkpoint)
    urls = [url for _m, url, _s in squid.log_since(mark)]
    assert any(u.startswith(hub.endpoint + "/api/models/") for u in urls)
    assert any(u.startswith(hub.cdn_endpoint) for u in urls)  # the CDN host too


async def test_proxy_credentials_go_with_every_plain_http_request(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """``http://USER:PASS@proxy``: each request to an ``http://`` target (the Hub, its CDN)
    carries ``Proxy-Authorization``, as a proxy that wants it (squid with basic auth) needs."""
    async with Relay() as proxy:
        address = proxy.url.removeprefix("http://")
        env = {"http_proxy": f"http://alice:s%40cret@{address}"}
        config = through(fast_config(tmp_path / "c", hub.endpoint), env)
        result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    expected = "Basic " + base64.b64encode(b"alice:s@cret").decode()
    sent = [dict((n.lower(), v) for n, v in r.request_fields) for r in proxy.log]
    assert any(r.url.startswith(hub.cdn_endpoint) for r in proxy.log)
    assert sent and all(fields.get("proxy-authorization") == expected for fields in sent)


@pytest.mark.parametrize("no_proxy", ["127.0.0.2", "127.0.0.0/8", "*"])
async def test_no_proxy_hosts_are_reached_directly(
    no_proxy: str, squid: Squid, hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    env = {"HTTP_PROXY": squid.url, "NO_PROXY": no_proxy}
    config = through(fast_config(tmp_path / "c", hub.endpoint), env)
    mark = squid.mark()
    result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    urls = [url for _m, url, _s in squid.log_since(mark)]
    assert not any(u.startswith(hub.cdn_endpoint) for u in urls)
    assert any(u.startswith(hub.endpoint) for u in urls) is (no_proxy == "127.0.0.2")


def test_the_cli_reads_the_proxy_from_its_environment(
    squid: Squid, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    from helpers import serving

    with serving({REPO: checkpoint}) as fake:
        mark = squid.mark()
        done = subprocess.run(
            [sys.executable, "-m", "shardsync.cli", "prefetch", REPO, "--no-daemon", "--quiet",
             "--cache-dir", str(tmp_path / "c"), "--endpoint", fake.endpoint],
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HTTP_PROXY": squid.url},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert_snapshot_matches(Path(done.stdout.strip()), checkpoint)
        assert any(url.startswith(fake.cdn_endpoint) for _m, url, _s in squid.log_since(mark))


# ------------------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    authority = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server)
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    authority.cert_pem.write_to_path(str(path))
    return server, path


@contextlib.asynccontextmanager
async def https_directory(root: Path, tls: ssl.SSLContext) -> AsyncIterator[str]:
    """A plain HTTPS file server (Range, ETag) for ``root``: a private-CA origin."""
    app = web.Application()
    app.router.add_static("/ckpt/", root)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
    try:
        yield f"https://127.0.0.1:{runner.addresses[0][1]}/ckpt/"
    finally:
        await runner.cleanup()


async def test_https_through_a_connect_tunnel_checks_the_origin_certificate(
    squid: Squid, checkpoint: Checkpoint, ca: tuple[ssl.SSLContext, Path], tmp_path: Path
) -> None:
    server, ca_file = ca
    async with https_directory(checkpoint.directory, server) as url:
        env = {"https_proxy": squid.url}
        untrusted = through(fast_config(tmp_path / "u"), env)
        with pytest.raises(TransferError) as caught:
            await prefetch(url, untrusted)
        assert "certificate" in str(caught.value).lower()

        mark = squid.mark()
        trusted = through(fast_config(tmp_path / "t"), {**env, "SSL_CERT_FILE": str(ca_file)})
        result = await prefetch(url, trusted)
        assert_same_files(result.snapshot_path, checkpoint)
        tunnels = [u for m, u, _s in squid.log_since(mark) if m == "CONNECT"]
        assert tunnels and all(u == url.split("/")[2] for u in tunnels)


async def test_a_private_ca_from_the_config_file(
    checkpoint: Checkpoint, ca: tuple[ssl.SSLContext, Path], tmp_path: Path
) -> None:
    server, ca_file = ca
    conf = tmp_path / "c.toml"
    conf.write_text(f'[network]\nca_bundle = "{ca_file}"\n')
    async with https_directory(checkpoint.directory, server) as url:
        network = load_config(conf, {"HOME": str(tmp_path)}).network
        config = replace(fast_config(tmp_path / "c"), network=network)
        result = await prefetch(url, config)
    assert_same_files(result.snapshot_path, checkpoint)


_EMPTY_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult '
    b'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>models-bucket</Name>'
    b"<Prefix>m/</Prefix><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys>"
    b"<IsTruncated>false</IsTruncated></ListBucketResult>"
)


@pytest.mark.parametrize("reads", ["direct", "botocore"])
async def test_s3_requests_trust_the_systems_cas_as_the_fetcher_does(
    reads: str, ca: tuple[ssl.SSLContext, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An on-premises store whose CA is installed system-wide (here a hashed CA folder, as
    ``update-ca-certificates`` keeps ``/etc/ssl/certs``, named by ``SSL_CERT_DIR``), with no
    bundle configured: botocore trusted its own bundle only, so listing it failed (TLS),
    while a plain URL on the same server was read. Read both ways: without botocore (the
    credentials in the environment) and through it (in the credentials file)."""
    server, ca_file = ca
    folder = tmp_path / "certs"
    folder.mkdir()
    hashed = await asyncio.to_thread(
        subprocess.run,
        ["openssl", "x509", "-hash", "-noout", "-in", str(ca_file)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    name = hashed.stdout.strip()
    (folder / f"{name}.0").write_bytes(ca_file.read_bytes())
    ssl_context(NetworkConfig())  # one this process made before the CA was installed
    monkeypatch.setenv("SSL_CERT_DIR", str(folder))
    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    credentials = tmp_path / "credentials"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    if reads == "botocore":
        credentials.write_text(
            "[default]\naws_access_key_id = AKIDEXAMPLE\naws_secret_access_key = " + "x" * 40
        )
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x" * 40)
    seen: list[str] = []

    async def listing(request: web.Request) -> web.Response:
        seen.append(request.path_qs)
        return web.Response(body=_EMPTY_LISTING, content_type="application/xml")

    app = web.Application()
    app.router.add_route("GET", "/{path:.*}", listing)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server).start()
    endpoint = f"https://127.0.0.1:{runner.addresses[0][1]}"
    s3 = S3Config(endpoint=endpoint, region="us-east-1", addressing="path")
    config = replace(fast_config(tmp_path / "c"), s3=s3, network=network_from_env({}))
    try:
        with pytest.raises(ManifestError):  # listed: an empty prefix has no weights
            await prefetch("s3://models-bucket/m/", config)
    finally:
        await runner.cleanup()
    assert any("list-type=2" in asked for asked in seen)


async def test_an_authenticating_squid_passes_plain_http_requests_with_the_credentials(
    authed_squid: Squid, hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The Hub's API, resolves and CDN bytes over http://, through squid with basic auth."""
    env = {"http_proxy": authed(authed_squid, *SQUID_USER)}
    config = through(fast_config(tmp_path / "c", hub.endpoint), env)
    mark = authed_squid.mark()
    result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    statuses = [status for _m, url, status in authed_squid.log_since(mark)]
    assert statuses and 407 not in statuses
    assert any(url.startswith(hub.cdn_endpoint) for _m, url, _s in authed_squid.log_since(mark))


async def test_an_authenticating_squid_opens_tunnels_with_the_credentials(
    authed_squid: Squid,
    checkpoint: Checkpoint,
    ca: tuple[ssl.SSLContext, Path],
    tmp_path: Path,
) -> None:
    server, ca_file = ca
    async with https_directory(checkpoint.directory, server) as url:
        env = {"https_proxy": authed(authed_squid, *SQUID_USER), "SSL_CERT_FILE": str(ca_file)}
        mark = authed_squid.mark()
        result = await prefetch(url, through(fast_config(tmp_path / "c"), env))
        assert_same_files(result.snapshot_path, checkpoint)
        seen = authed_squid.log_since(mark)
    assert [m for m, _u, status in seen if m == "CONNECT" and status == 200]
    assert 407 not in [status for _m, _u, status in seen]


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_wrong_proxy_password_is_one_auth_error_that_says_they_were_sent(
    authed_squid: Squid, hub: FakeHub, scheme: str, tmp_path: Path
) -> None:
    wrong = "not-the-password"
    env = {f"{scheme}_proxy": authed(authed_squid, SQUID_USER[0], wrong)}
    config = through(fast_config(tmp_path / "c", hub.endpoint), env)
    source = REPO if scheme == "http" else "https://127.0.0.1:1/ckpt/"
    with pytest.raises(AuthError) as caught:
        await prefetch(source, config)
    message = str(caught.value)
    assert "407" in message and "refused the credentials" in message
    assert wrong not in message and SQUID_USER[0] not in message


# ------------------------------------------------------------------------------ bad proxies


@contextlib.asynccontextmanager
async def fake_proxy(answer: bytes | None) -> AsyncIterator[str]:
    """A proxy that answers every request with ``answer``, or drops the connection."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await reader.readuntil(b"\r\n\r\n")
            if answer is not None:
                writer.write(answer)
                await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


_407 = (
    b"HTTP/1.1 407 Proxy Authentication Required\r\n"
    b'Proxy-Authenticate: Basic realm="corp"\r\nContent-Length: 0\r\n\r\n'
)


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_asking_for_credentials_is_one_auth_error_without_them(
    scheme: str, hub: FakeHub, tmp_path: Path
) -> None:
    async with fake_proxy(_407) as address:
        proxy = f"http://alice:hunter2@{address}"
        config = through(fast_config(tmp_path / "c", hub.endpoint), {f"{scheme}_proxy": proxy})
        source = REPO if scheme == "http" else "https://127.0.0.1:1/ckpt/"
        with pytest.raises(AuthError) as caught:
            await prefetch(source, config)
    assert "hunter2" not in str(caught.value) and "alice" not in str(caught.value)
    assert "407" in str(caught.value)


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_asking_for_credentials_of_s3_requests_is_one_auth_error(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same 407 on the S3 client's requests (a listing): an ``AuthError`` (exit 4), not a
    store's error (exit 6) on an http endpoint, nor an unreachable endpoint on https."""
    for var, value in (("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"), ("AWS_SECRET_ACCESS_KEY", "x" * 40)):
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    s3 = S3Config(endpoint=f"{scheme}://127.0.0.1:9", region="us-east-1", addressing="path")
    async with fake_proxy(_407) as address:
        proxy = f"http://alice:hunter2@{address}"
        config = replace(through(fast_config(tmp_path / "c"), {f"{scheme}_proxy": proxy}), s3=s3)
        with pytest.raises(AuthError) as caught:
            await prefetch("s3://models-bucket/m/", config)
    assert "hunter2" not in str(caught.value) and "alice" not in str(caught.value)
    assert "407" in str(caught.value)


async def test_a_proxy_that_drops_connections_gives_up_after_bounded_retries(
    hub: FakeHub, tmp_path: Path
) -> None:
    async with fake_proxy(None) as address:
        config = through(
            fast_config(tmp_path / "c", hub.endpoint), {"http_proxy": f"http://u:pw@{address}"}
        )
        with pytest.raises(TransferError) as caught:
            await asyncio.wait_for(prefetch(REPO, config), 60)
    assert "pw@" not in str(caught.value)
    assert hub.log == []  # nothing reached the Hub around the proxy


# ------------------------------------------------------------------------------ mirrors


@contextlib.contextmanager
def nginx_mirror(hub: FakeHub, work: Path, *, hide: str = "") -> Iterator[str]:
    """nginx in front of the Hub, answering resolves with 200 (it follows the CDN redirect
    itself), like an Artifactory/Nexus remote repository; ``hide`` drops a header."""
    hidden = f"proxy_hide_header {hide};" if hide else ""
    with run_nginx(
        work,
        f"""location / {{
            proxy_pass {hub.endpoint};
            proxy_intercept_errors on;
            error_page 301 302 307 = @cdn;
            {hidden}
        }}
        location @cdn {{
            set $target $upstream_http_location;
            proxy_pass $target;
            {hidden}
        }}""",
    ) as url:
        yield url


@pytest.mark.nginx
@pytest.mark.parametrize("hide", ["", "X-Linked-Etag"])
def test_a_mirror_answering_200_stays_verified(
    hide: str, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    from helpers import serving

    with serving({REPO: checkpoint}) as fake, nginx_mirror(fake, tmp_path / "n", hide=hide) as url:
        config = fast_config(tmp_path / "c", url)
        result = asyncio.run(prefetch(REPO, config))
        assert_snapshot_matches(result.snapshot_path, checkpoint)
        verified = {f.path: f.verified for f in result.files}
        assert {verified[s] for s in checkpoint.shards} == {"sha256"}

        fake.faults.add(FlipByte(path=checkpoint.shards[0], times=None))  # the mirror lies
        with pytest.raises(IntegrityError):
            asyncio.run(prefetch(REPO, fast_config(tmp_path / "c2", url)))
        assert_store_verified(tmp_path / "c2", checkpoint)


def test_network_config_defaults_are_direct() -> None:
    net = NetworkConfig()
    assert net.proxy_for("https://huggingface.co/x") is None and net.ca_bundle is None


async def test_s3_requests_go_through_the_proxy_too(
    squid: Squid, s3server: S3Server, s3bucket: str, checkpoint: Checkpoint, aws_env: None,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Listing and HEADs (aiobotocore) and the presigned GETs (the fetcher) alike."""
    import botocore.session

    client = botocore.session.get_session().create_client("s3", **s3server.client_kwargs())
    for rel in checkpoint.files:
        client.put_object(Bucket=s3bucket, Key=f"m/{rel}", Body=checkpoint.path(rel).read_bytes())
    s3 = S3Config(endpoint=s3server.endpoint, region=s3server.region, addressing="path")
    config = replace(
        fast_config(tmp_path / "c"), s3=s3, network=network_from_env({"http_proxy": squid.url})
    )
    mark = squid.mark()
    result = await prefetch(f"s3://{s3bucket}/m/", config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    seen = squid.log_since(mark)
    assert any(m == "GET" and "list-type=2" in u for m, u, _s in seen)  # ListObjectsV2
    assert any(m == "HEAD" for m, _u, _s in seen)
    assert any(m == "GET" and "X-Amz-Signature=" in u for m, u, _s in seen)  # presigned


async def test_extra_headers_go_to_the_matching_hosts_only(
    hub: FakeHub, checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """What a Dragonfly setup needs: a stable tag on the CDN's requests (the fake Hub's log
    shows what was sent; Dragonfly itself cannot run here)."""
    network = network_from_env({}, headers={"127.0.0.2": {"X-Dragonfly-Tag": "fleet-a"}})
    config = replace(fast_config(tmp_path / "c", hub.endpoint), network=network)
    result = await prefetch(REPO, config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    cdn = [r for r in hub.log if r.server == "cdn"]
    api = [r for r in hub.log if r.server == "hub"]
    assert cdn and all(r.headers.get("X-Dragonfly-Tag") == "fleet-a" for r in cdn)
    assert api and all("X-Dragonfly-Tag" not in r.headers for r in api)


def test_load_goes_through_the_proxy(squid: Squid, checkpoint: Checkpoint, tmp_path: Path) -> None:
    from helpers import serving
    from safetensors.torch import load_file

    import shardsync

    with serving({REPO: checkpoint}) as fake:
        config = through(fast_config(tmp_path / "c", fake.endpoint), {"HTTP_PROXY": squid.url})
        mark = squid.mark()
        tensors = shardsync.load(REPO, config=config, device_map="cpu")
        assert any(u.startswith(fake.cdn_endpoint) for _m, u, _s in squid.log_since(mark))
    expected = {}
    for shard in checkpoint.shards:
        expected.update(load_file(checkpoint.path(shard)))
    assert set(tensors) == set(expected)
    for name, tensor in expected.items():
        assert tensors[name].dtype == tensor.dtype and tensors[name].equal(tensor)


@pytest.mark.parametrize(
    "endpoint_from", ["config", "AWS_ENDPOINT_URL", "profile", "no-http-proxy"]
)
async def test_no_proxy_keeps_s3_requests_direct(
    endpoint_from: str, squid: Squid, s3server: S3Server, s3bucket: str, checkpoint: Checkpoint,
    aws_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Our NO_PROXY rules (CIDRs too) decide for botocore's requests as well, though it
    reads the same variables itself (without CIDRs), for the URL each request goes to:
    also where the endpoint comes from the AWS profile (``endpoint_url``), which botocore
    reads and we do not (a guess of AWS's https endpoint put its proxy on every request)."""
    import botocore.session

    # uploaded before the proxy variables are set: squid logs a request when it ends, so a
    # proxied upload's line could land after the mark below and look like ours
    client = botocore.session.get_session().create_client("s3", **s3server.client_kwargs())
    for rel in checkpoint.files:
        client.put_object(Bucket=s3bucket, Key=f"m/{rel}", Body=checkpoint.path(rel).read_bytes())
    for name in ("HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, squid.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.0/8")
    s3 = S3Config(endpoint=s3server.endpoint, region=s3server.region, addressing="path")
    if endpoint_from == "AWS_ENDPOINT_URL":  # the chain names the endpoint, not [s3]
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3server.endpoint)
        s3 = replace(s3, endpoint=None)
    elif endpoint_from == "profile":
        profile = f"[default]\nendpoint_url = {s3server.endpoint}\n"
        await asyncio.to_thread(Path(os.environ["AWS_CONFIG_FILE"]).write_text, profile)
        s3 = replace(s3, endpoint=None)
    env = {"HTTP_PROXY": squid.url, "HTTPS_PROXY": squid.url, "NO_PROXY": "127.0.0.0/8"}
    config = replace(fast_config(tmp_path / "c"), s3=s3, network=network_from_env(env))
    mark = squid.mark()
    result = await prefetch(f"s3://{s3bucket}/m/", config)
    assert_snapshot_matches(result.snapshot_path, checkpoint)
    store = s3server.endpoint.split("//", 1)[1]  # 127.0.0.1:PORT: earlier tests' late lines
    assert [line for line in squid.log_since(mark) if store in line[1]] == []


def test_a_ca_bundle_is_loaded_once_until_it_changes_on_disk(tmp_path: Path) -> None:
    """One context per bundle (loading it took 17 ms, asked three times a run), and a
    bundle replaced on disk (a rotated private CA) is trusted as it is now."""
    bundle = tmp_path / "ca.pem"
    first, second = trustme.CA(), trustme.CA()
    first.cert_pem.write_to_path(str(bundle))
    network = NetworkConfig(ca_bundle=bundle)
    context = ssl_context(network)
    assert ssl_context(network) is context
    second.cert_pem.write_to_path(str(tmp_path / "new.pem"))
    (tmp_path / "new.pem").replace(bundle)  # as a rotation replaces it
    trusted = ssl_context(network).get_ca_certs(binary_form=True)
    assert ssl.PEM_cert_to_DER_cert(second.cert_pem.bytes().decode()) in trusted
