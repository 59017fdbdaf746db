from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest

from shardsync.config import (
    _FETCH_KEYS,
    SYSTEM_SOCKET,
    DaemonConfig,
    client_sockets,
    daemon_socket,
    load_config,
    parse_size,
)
from shardsync.errors import ConfigError
from shardsync.records import FetchConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        ("16MiB", 16 << 20),
        ("2GB", 2_000_000_000),
        ("500G", 500 * 10**9),
        ("1.5 KiB", 1536),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-5", "1e", True, "1e400", "9" * 400])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_every_fetch_key_exists() -> None:
    assert set(_FETCH_KEYS) <= {f.name for f in fields(FetchConfig)}


def test_example_config_is_the_defaults(tmp_path: Path) -> None:
    example = load_config(ROOT / "config.example.toml", {}, cache_dir=tmp_path)
    assert example == load_config(None, {}, cache_dir=tmp_path)


def test_cache_dir_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cache]\ndir = "{tmp_path / "from-file"}"\n')
    assert load_config(cfg, {}).cache_dir == tmp_path / "from-file"
    env = {"SHARDSYNC_CACHE_DIR": str(tmp_path / "from-env")}
    assert load_config(cfg, env).cache_dir == tmp_path / "from-env"
    assert load_config(cfg, env, cache_dir=tmp_path / "arg").cache_dir == tmp_path / "arg"
    assert load_config(None, {"XDG_CACHE_HOME": "/x"}).cache_dir == Path("/x/shardsync")


def test_env_overrides(tmp_path: Path) -> None:
    env = {"SHARDSYNC_MAX_FILES": "7", "SHARDSYNC_CHUNK_SIZE": "8MiB", "HF_ENDPOINT": "http://h"}
    cfg = load_config(None, env, cache_dir=tmp_path)
    assert (cfg.max_files, cfg.fetch.chunk_size, cfg.endpoint) == (7, 8 << 20, "http://h")


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[download]\nconnections_per_file = 'x'\n", "download.connections_per_file"),
        ("[download]\nchunk_size = 'lots'\n", "download.chunk_size"),
        ("[download]\nbogus = 1\n", "download.bogus"),
        ("[s3]\nconnections_per_file = 0\n", "s3.connections_per_file"),
        ("[s3]\nconnections_per_file = true\n", "s3.connections_per_file"),
        ("[s3]\nchunk_size = '512KiB'\n", "s3.chunk_size"),
        ("[s3]\nchunk_size = 'big'\n", "s3.chunk_size"),
        ("[s3]\nrequester_pays = 'yes'\n", "s3.requester_pays"),
        ("[nope]\n", "nope"),
        ("[retry]\nmax_attempts = 0\n", "max_attempts"),
        ("[tier]\nclaim_courtesy = 'soon'\n", "tier.claim_courtesy"),
        ("[tier]\nclaim_courtesy = '-1s'\n", "tier.claim_courtesy"),
        ("[tier]\nclaim_lease = 0\n", "tier.claim_lease"),
        ("[download\n", "c.toml"),
        ("[download]\nchunk_size = '1e400'\n", "download.chunk_size"),  # no int() of inf
        ("[download]\nread_timeout = nan\n", "download.read_timeout"),  # TOML has nan, inf
        ("[download]\nconnect_timeout = inf\n", "download.connect_timeout"),
        ("[network]\nmetadata_timeout = nan\n", "network.metadata_timeout"),
        ("[retry]\nbase_delay = 5\nmax_delay = 1\n", "retry.max_delay"),
        ("[tier]\nurl = 's3://a..b/x'\n", "tier.url"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    with pytest.raises(ConfigError, match=needle):
        load_config(cfg, {}, cache_dir=tmp_path)


def test_s3_ranges_have_their_own_size(tmp_path: Path) -> None:
    """``[s3] chunk_size`` sizes S3 ranges; ``[download]``'s stays for every other origin."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[download]\nchunk_size = "2MiB"\n[s3]\nchunk_size = "8MiB"\n')
    config = load_config(cfg, {}, cache_dir=tmp_path)
    assert (config.fetch.chunk_size, config.s3.chunk_size) == (2 << 20, 8 << 20)
    assert not config.s3.requester_pays
    cfg.write_text("[s3]\nrequester_pays = true\n")
    assert load_config(cfg, {}, cache_dir=tmp_path).s3.requester_pays


def test_bad_env_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SHARDSYNC_MAX_FILES"):
        load_config(None, {"SHARDSYNC_MAX_FILES": "many"}, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="SHARDSYNC_CHUNK_SIZE"):
        load_config(None, {"SHARDSYNC_CHUNK_SIZE": "1e400"}, cache_dir=tmp_path)


@pytest.mark.parametrize(
    "endpoint",
    ["https://mirror-user:s3cr3t-token@mirror.example", "https://s3cr3t-token@mirror.example"],
)
def test_a_hub_endpoint_with_credentials_is_refused_without_echoing_them(
    tmp_path: Path, endpoint: str
) -> None:
    """The Hub endpoint is reported by ``status`` (over TCP too), events and logs: a password
    in it would reach them all (promise 12). The Hub takes a token (``HF_TOKEN``) instead,
    S3 the credential chain."""
    hub, s3 = tmp_path / "hub.toml", tmp_path / "s3.toml"
    hub.write_text(f'[hub]\nendpoint = "{endpoint}"\n')
    s3.write_text(f'[s3]\nendpoint = "{endpoint}"\n')
    for source, environ in ((hub, {}), (s3, {}), (None, {"HF_ENDPOINT": endpoint})):
        with pytest.raises(ConfigError) as refused:
            load_config(source, environ, cache_dir=tmp_path)
        assert "s3cr3t-token" not in str(refused.value)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"\xff\xfe[download]\n")
    with pytest.raises(ConfigError, match=r"c\.toml"):
        load_config(cfg, {}, cache_dir=tmp_path)


# -- [daemon] -------------------------------------------------------------------------------


def test_daemon_section(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[daemon]\nsocket = "/run/x/s.sock"\ngroup = 65534\nallowed_uids = ["root", 1000]\n'
        'tcp = "[::1]:9464"\nmax_bandwidth = "100MB"\nfallback = "error"\nhistory = 5\n'
    )
    daemon = load_config(cfg, {}, cache_dir=tmp_path).daemon
    assert daemon.socket == Path("/run/x/s.sock")
    assert (daemon.group, daemon.socket_mode) == (65534, 0o660)  # group-accessible by default
    assert daemon.allowed_uids == {0, 1000} and daemon.allowed_gids == {65534}
    assert daemon.tcp == ("::1", 9464) and daemon.max_bandwidth == 100_000_000
    assert (daemon.fallback, daemon.history) == ("error", 5)
    cfg.write_text('[daemon]\ngroup = 65534\nallowed_gids = []\nsocket_mode = "0600"\n')
    daemon = load_config(cfg, {}, cache_dir=tmp_path).daemon
    assert daemon.allowed_gids == frozenset() and daemon.socket_mode == 0o600
    cfg.write_text('[daemon]\ntcp = "0.0.0.0:9464"\ntcp_allow_remote = true\n')
    assert load_config(cfg, {}, cache_dir=tmp_path).daemon.tcp == ("0.0.0.0", 9464)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('socket_mode = "0777"', "daemon.socket_mode"),
        ("socket_mode = 0o700", "daemon.socket_mode"),
        ('socket_mode = "rw"', "daemon.socket_mode"),
        ('group = "no-such-group-here"', "daemon.group"),
        ('allowed_uids = "root"', "daemon.allowed_uids"),
        ("allowed_uids = [-1]", "daemon.allowed_uids"),
        ('allowed_gids = ["no-such-group-here"]', "daemon.allowed_gids"),
        ('tcp = "10.0.0.1:9464"', "daemon.tcp"),
        ('tcp = "nope"', "daemon.tcp"),
        ('tcp = "127.0.0.1:99999"', "daemon.tcp"),
        ('tcp = "127.0.0.1:\u00b2"', "daemon.tcp"),  # a digit to str.isdigit, not to int
        ('tcp_allow_remote = "yes"', "daemon.tcp_allow_remote"),
        ('fallback = "sometimes"', "daemon.fallback"),
        ("history = 0", "daemon.history"),
        ('max_bandwidth = "1KB"', "daemon.max_bandwidth"),
        ("socket = 5", "daemon.socket"),
        ("bogus = 1", "daemon.bogus"),
    ],
)
def test_invalid_daemon_config_names_the_key(tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[daemon]\n{body}\n")
    with pytest.raises(ConfigError, match=needle):
        load_config(cfg, {}, cache_dir=tmp_path)


def test_daemon_env_overrides(tmp_path: Path) -> None:
    env = {
        "SHARDSYNC_SOCKET": "/tmp/s/d.sock",
        "SHARDSYNC_FALLBACK": "error",
        "SHARDSYNC_MAX_BANDWIDTH": "1GB",
    }
    daemon = load_config(None, env, cache_dir=tmp_path).daemon
    assert (daemon.socket, daemon.fallback, daemon.max_bandwidth) == (
        Path("/tmp/s/d.sock"),
        "error",
        10**9,
    )
    with pytest.raises(ConfigError, match="SHARDSYNC_FALLBACK"):
        load_config(None, {"SHARDSYNC_FALLBACK": "never"}, cache_dir=tmp_path)


def test_socket_locations() -> None:
    default = DaemonConfig()
    uid = os.getuid()
    assert daemon_socket(default, {"RUNTIME_DIRECTORY": "/run/a:/run/b"}) == Path(
        "/run/a/shardsync.sock"
    )
    xdg = {"XDG_RUNTIME_DIR": "/run/user/7"}
    assert daemon_socket(default, xdg) == Path("/run/user/7/shardsync/shardsync.sock")
    assert daemon_socket(default, {}) == Path(f"/tmp/shardsync-{uid}/shardsync.sock")
    # clients look for their own daemon, then the system one, then the /tmp fallback
    assert client_sockets(default, xdg) == (
        Path("/run/user/7/shardsync/shardsync.sock"),
        SYSTEM_SOCKET,
        Path(f"/tmp/shardsync-{uid}/shardsync.sock"),
    )
    assert client_sockets(default, {}) == (
        SYSTEM_SOCKET,
        Path(f"/tmp/shardsync-{uid}/shardsync.sock"),
    )
    explicit = DaemonConfig(socket=Path("/x.sock"))
    assert daemon_socket(explicit, xdg) == Path("/x.sock")
    assert client_sockets(explicit, xdg) == (Path("/x.sock"),)
