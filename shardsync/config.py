"""Configuration: frozen dataclasses from TOML, environment overrides applied on request.

Nothing is read at import time; ``load_config(path, environ)`` is the one place
that looks at files and variables, so tests pass both explicitly.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from shardsync.config_access import group_id, id_list, socket_mode, tcp_address, user_id
from shardsync.errors import ConfigError, redact
from shardsync.names import parse_s3_url
from shardsync.network import NetworkConfig, S3Config, network_from_env
from shardsync.records import FetchConfig
from shardsync.retry import RetryPolicy

__all__ = [
    "SYSTEM_SOCKET",
    "Config",
    "DaemonConfig",
    "PruneConfig",
    "S3Config",
    "TierConfig",
    "client_sockets",
    "daemon_socket",
    "default_cache_dir",
    "load_config",
    "parse_duration",
    "parse_size",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: str | int) -> int:
    """``"16MiB"``, ``"2GB"``, ``"500G"`` or a plain integer of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("size must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError(f"not a size: {value!r}")
    text = value.strip().lower().replace(" ", "")
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits) :]
    if unit not in _UNITS or not digits:
        raise ValueError(f"not a size: {value!r}")
    number = float(digits) * _UNITS[unit]
    if number < 0:
        raise ValueError("size must not be negative")
    if not math.isfinite(number):  # "1e400": no int() of it
        raise ValueError(f"not a size: {value!r}")
    return int(number)


_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(value: str | int | float) -> float:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"45s"``, ``"2w"`` or a plain number of seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        number = text.rstrip("smhdw")
        unit = text[len(number) :]
        if unit not in _DURATION_UNITS or not number:
            raise ValueError(f"not a duration: {value!r}")
        try:
            seconds = float(number) * _DURATION_UNITS[unit]
        except ValueError:
            raise ValueError(f"not a duration: {value!r}") from None
    else:
        raise ValueError(f"not a duration: {value!r}")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"a duration must be a finite number >= 0, not {value!r}")
    return seconds


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``SHARDSYNC_CACHE_DIR``, else ``$CACHE_DIRECTORY`` (what systemd's ``CacheDirectory=``
    made for a unit), else ``$XDG_CACHE_HOME/shardsync``, else ``~/.cache/shardsync``."""
    if environ.get("SHARDSYNC_CACHE_DIR"):
        return Path(environ["SHARDSYNC_CACHE_DIR"]).expanduser()
    unit = environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if unit:
        return Path(unit)
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "shardsync"


SYSTEM_SOCKET = Path("/run/shardsync/shardsync.sock")
"""Where the systemd unit's daemon listens (``RuntimeDirectory=shardsync``)."""

Fallback = Literal["in-process", "error"]


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """The ``[daemon]`` section: the socket and who may use it, global limits, client fallback.

    ``socket`` None means the default location (see ``socket_candidates``), which depends on
    the environment and so is resolved when used, not when loaded.
    """

    socket: Path | None = None
    socket_mode: int = 0o600
    group: int | None = None  # gid owning the socket (and its directory), for shared access
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    tcp: tuple[str, int] | None = None  # (host, port) of the metrics/status listener
    tcp_allow_remote: bool = False
    max_bandwidth: int = 0  # bytes/s for all downloads together; 0 = unlimited
    fallback: Fallback = "in-process"
    history: int = 100  # finished jobs remembered for GET /v1/jobs


@dataclass(frozen=True, slots=True)
class PruneConfig:
    """The ``[prune]`` section: limits for ``shardsync prune`` and the daemon's auto-prune.

    None means no such limit. ``pin`` holds repo names or ``fnmatch`` patterns that are never
    pruned. ``high_water`` is the cache size at which the daemon prunes on its own (down to
    ``max_size``); None means ``max_size`` itself.
    """

    max_size: int | None = None
    min_free: int | None = None
    max_age: float | None = None  # seconds
    pin: tuple[str, ...] = ()
    stale_partial_age: float = 86400.0  # seconds
    high_water: int | None = None


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The ``[tier]`` section: the fleet's shared S3 tier (``url`` None: no tier).

    ``claim_lease``: how long a claim lives without renewal (a dead holder is taken over
    after it; the holder renews every fifth of it). ``claim_stall``: how long a waiting host
    accepts no progress from the holder before it downloads from the origin itself.
    ``upload_floor``: the slowest upload rate (bytes/s) a waiting host tolerates from the
    holder once its download is done. ``part_size``: the blocks a holder publishes as it
    downloads, for a host that takes its claim over to resume from (0: none); its download
    is held within eight of them of what the tier has taken (``tier_parts.Lead``).
    ``claim_courtesy``: how long a host that already downloads a blob for the fleet lets
    the others claim the next one first (0: claim at once).
    """

    url: str | None = None
    # 4 s: a dead holder costs the waiters seconds (30 s cost 47 s against 17 s); a live one
    # misses four renewals (0.8 s apart, one PUT each) before it is taken for dead
    claim_lease: float = 4.0
    claim_stall: float = 60.0
    upload_floor: int = 8 << 20
    # 4 MiB: a quarter of a Range (chunk_size): a holder killed mid-download costs less than
    # a piece per connection it had open; the parts cost one more write of the blob to the tier
    part_size: int = 4 << 20
    # 2 s: hosts started together arrive within it (8 on 2 cores reached their claims up
    # to ~2 s apart; 0.5 s left one host all four blobs in 2 of 3 rounds), each wins a claim,
    # and a dead host holds one blob (one host holding all four cost 1.15-1.31x the egress)
    claim_courtesy: float = 2.0


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the engine needs; see ``config.example.toml`` for each key."""

    cache_dir: Path
    endpoint: str | None = None
    max_files: int = 4
    fetch: FetchConfig = field(default_factory=FetchConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    s3: S3Config = field(default_factory=S3Config)
    tier: TierConfig = field(default_factory=TierConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)


def daemon_socket(daemon: DaemonConfig, environ: Mapping[str, str]) -> Path:
    """Where the daemon listens: ``daemon.socket``, else ``$RUNTIME_DIRECTORY/shardsync.sock``
    (systemd), else ``$XDG_RUNTIME_DIR/shardsync/shardsync.sock``, else
    ``/tmp/shardsync-$UID/shardsync.sock``."""
    if daemon.socket is not None:
        return daemon.socket
    runtime = environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    if runtime:
        return Path(runtime) / "shardsync.sock"
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "shardsync" / "shardsync.sock"
    return Path(f"/tmp/shardsync-{os.getuid()}") / "shardsync.sock"


def client_sockets(daemon: DaemonConfig, environ: Mapping[str, str]) -> tuple[Path, ...]:
    """Where clients look for a daemon, in order: the configured socket only, else the
    user's own daemon, then the system daemon's socket (which a user's environment does not
    name), then the ``/tmp`` fallback."""
    if daemon.socket is not None:
        return (daemon.socket,)
    own = daemon_socket(daemon, environ)
    tmp = Path(f"/tmp/shardsync-{os.getuid()}") / "shardsync.sock"
    return tuple(dict.fromkeys((own, SYSTEM_SOCKET, tmp) if own != tmp else (SYSTEM_SOCKET, tmp)))


_S3_TRANSFER_KEYS = ("connections_per_file", "chunk_size")
_FETCH_KEYS = {
    "connections_per_file": int,
    "chunk_size": "size",
    "read_size": "size",
    "write_size": "size",
    "connect_timeout": float,
    "read_timeout": float,
    "min_throughput": "size",
    "throughput_window": float,
    "sidecar_interval": float,
    "sidecar_bytes": "size",
    "max_verify_attempts": int,
}
_RETRY_KEYS = {
    "max_attempts": int,
    "base_delay": float,
    "max_delay": float,
    "max_retry_after": float,
}


def check_endpoint(source: str, endpoint: object, example: str = "https://huggingface.co") -> str:
    """An endpoint: an ``http(s)://HOST[:PORT][/PATH]`` URL with no ``user:password@`` (it is
    reported by ``status``, events and logs; the Hub takes ``HF_TOKEN``, S3 the credential
    chain); ``source`` names where it came from (``--endpoint``, ``HF_ENDPOINT``,
    ``hub.endpoint``, ``s3.endpoint``) in the error, which never quotes a credential."""
    try:
        parts = urlsplit(endpoint) if isinstance(endpoint, str) else None
        if parts is not None:
            parts.port  # noqa: B018  (a port that is no number raises here)
    except ValueError:  # "http://h:port", "http://[::1"
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or (parts.query or parts.fragment)
        or parts.username is not None
        or parts.password is not None
    ):
        shown = redact(endpoint) if isinstance(endpoint, str) else endpoint
        raise ConfigError(
            f"{source} must be an http(s) URL like {example}, without user:password@ "
            f"(got {shown!r})"
        )
    return endpoint  # type: ignore[return-value]


def _coerce(key: str, value: Any, kind: object) -> Any:
    if kind == "size":
        try:
            return parse_size(value)
        except ValueError:
            raise ConfigError(
                f"{key}: expected a size in bytes or with a unit, like 16MiB, 2GB or 500G "
                f"(got {value!r})"
            ) from None
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected a whole number (got {value!r})")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number (got {value!r})")
        if not math.isfinite(value):  # TOML has nan and inf: a timeout of either bounds nothing
            raise ConfigError(f"{key}: expected a finite number (got {value!r})")
        return float(value)
    raise ConfigError(f"{key}: unsupported")


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table")
    return value


_FILE_KEY_PREFIXES = (
    "[",
    "unknown ",
    "cache.",
    "download.",
    "retry.",
    "hub.",
    "daemon.",
    "prune.",
    "s3.",
    "tier.",
    "network.",
)


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    cache_dir: Path | None = None,
) -> Config:
    """Build the config: file, then ``SHARDSYNC_*``/``HF_ENDPOINT`` variables, then arguments.

    Every invalid value is one ``ConfigError`` naming where it came from: the environment
    variable, or ``FILE: section.key`` for a key of the config file, and the accepted form.
    """
    try:
        return _load_config(path, environ, cache_dir=cache_dir)
    except ConfigError as exc:
        if path is not None and str(exc).startswith(_FILE_KEY_PREFIXES):
            raise ConfigError(f"{path}: {exc}") from None
        raise


def _load_config(
    path: Path | None,
    environ: Mapping[str, str] | None,
    *,
    cache_dir: Path | None,
) -> Config:
    env = os.environ if environ is None else environ
    data: Mapping[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not UTF-8 text (TOML is)") from None
    known = {"cache", "download", "retry", "hub", "daemon", "prune", "s3", "tier", "network"}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown config section or key {key!r}")
    cache = _section(data, "cache")
    download = dict(_section(data, "download"))
    retry = _section(data, "retry")
    hub = _section(data, "hub")
    for section, allowed in (
        ("cache", {"dir"}),
        ("download", set(_FETCH_KEYS) | {"max_files"}),
        ("retry", set(_RETRY_KEYS)),
        ("hub", {"endpoint"}),
        ("daemon", set(_DAEMON_KEYS)),
        ("prune", set(_PRUNE_KEYS)),
        (
            "s3",
            {"endpoint", "region", "addressing", "profile", "requester_pays", *_S3_TRANSFER_KEYS},
        ),
        (
            "tier",
            {"url", "claim_lease", "claim_stall", "claim_courtesy", "upload_floor", "part_size"},
        ),
        ("network", {"proxy", "no_proxy", "ca_bundle", "metadata_timeout", "headers"}),
    ):
        for key in _section(data, section):
            if key not in allowed:
                raise ConfigError(f"unknown key {section}.{key}")

    labels = {k: f"download.{k}" for k in (*_FETCH_KEYS, "max_files")}
    labels.update((k, f"retry.{k}") for k in _RETRY_KEYS)
    for env_key, key in (
        ("SHARDSYNC_MAX_FILES", "max_files"),
        ("SHARDSYNC_CONNECTIONS_PER_FILE", "connections_per_file"),
        ("SHARDSYNC_CHUNK_SIZE", "chunk_size"),
    ):
        if env_key in env:
            raw = env[env_key]
            download[key] = raw if key == "chunk_size" else _int_env(env_key, raw)
            labels[key] = env_key

    fetch_kwargs = {
        k: _coerce(labels[k], download[k], t) for k, t in _FETCH_KEYS.items() if k in download
    }
    retry_kwargs = {
        k: _coerce(labels[k], retry[k], t) for k, t in _RETRY_KEYS.items() if k in retry
    }
    max_files = _coerce(labels["max_files"], download.get("max_files", 4), int)
    for name, value in (*fetch_kwargs.items(), *retry_kwargs.items(), ("max_files", max_files)):
        if isinstance(value, int | float) and value <= 0 and name != "base_delay":
            raise ConfigError(f"{labels[name]} must be positive (got {value!r})")

    try:
        retry_policy = replace(RetryPolicy(), **retry_kwargs)
    except ConfigError as exc:  # the policy's own checks, which name the key but no section
        raise ConfigError(f"retry.{exc}") from None
    fetch = replace(FetchConfig(), **fetch_kwargs, retry=retry_policy)
    if cache_dir is None:
        configured = cache.get("dir")
        if configured is not None and not isinstance(configured, str):
            raise ConfigError("cache.dir must be a string")
        cache_dir = (
            Path(env["SHARDSYNC_CACHE_DIR"]).expanduser()
            if env.get("SHARDSYNC_CACHE_DIR")
            else Path(configured).expanduser()
            if configured
            else default_cache_dir(env)
        )
    endpoint = env.get("HF_ENDPOINT") or hub.get("endpoint")
    if endpoint is not None:
        check_endpoint("HF_ENDPOINT" if env.get("HF_ENDPOINT") else "hub.endpoint", endpoint)
    daemon = _daemon_config(_section(data, "daemon"), env)
    if daemon.max_bandwidth:
        floor = fetch.min_throughput * max_files * fetch.connections_per_file
        if daemon.max_bandwidth < floor:
            source = (
                "SHARDSYNC_MAX_BANDWIDTH"
                if env.get("SHARDSYNC_MAX_BANDWIDTH")
                else "daemon.max_bandwidth"
            )
            raise ConfigError(
                f"{source}: {daemon.max_bandwidth} B/s cannot give each of "
                f"max_files * connections_per_file connections the download.min_throughput "
                f"of {fetch.min_throughput} B/s (needs at least {floor} B/s)"
            )
    prune = _prune_config(_section(data, "prune"))
    s3 = _s3_config(_section(data, "s3"))
    tier = _tier_config(_section(data, "tier"), env)
    network = _network_config(_section(data, "network"), env)
    return Config(
        cache_dir=cache_dir,
        endpoint=endpoint,
        max_files=max_files,
        fetch=fetch,
        daemon=daemon,
        prune=prune,
        s3=s3,
        tier=tier,
        network=network,
    )


def _network_config(section: Mapping[str, Any], env: Mapping[str, str]) -> NetworkConfig:
    """``[network]`` over the proxy and CA variables (see ``shardsync.network``)."""
    texts: dict[str, str | None] = {}
    for key in ("proxy", "no_proxy", "ca_bundle"):
        value = section.get(key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"network.{key} must be a string (got {value!r})")
        texts[key] = value
    headers = section.get("headers", {})
    if not isinstance(headers, dict) or not all(
        isinstance(v, dict)
        and all(isinstance(k2, str) and isinstance(v2, str) for k2, v2 in v.items())
        for v in headers.values()
    ):
        raise ConfigError(
            "network.headers must map host globs to header tables, e.g. "
            '[network.headers."*.example.com"] X-Tag = "value"'
        )
    for pattern, table in headers.items():
        for name, value in table.items():
            if not _HEADER_NAME.fullmatch(name) or any(c in value for c in "\r\n\0"):
                raise ConfigError(f"network.headers.{pattern}: invalid header {name!r}")
    timeout = 120.0
    if "metadata_timeout" in section:
        timeout = _coerce("network.metadata_timeout", section["metadata_timeout"], float)
        if timeout <= 0:
            raise ConfigError("network.metadata_timeout must be positive")
    return network_from_env(
        env,
        proxy=texts["proxy"],
        no_proxy=texts["no_proxy"],
        ca_bundle=texts["ca_bundle"],
        headers=headers,
        metadata_timeout=timeout,
    )


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


def _tier_config(section: Mapping[str, Any], env: Mapping[str, str]) -> TierConfig:
    """Validate ``[tier]``; ``SHARDSYNC_TIER_URL`` overrides its url ("" turns the tier off)."""
    url = section.get("url")
    source = "tier.url"
    if "SHARDSYNC_TIER_URL" in env:
        url, source = env["SHARDSYNC_TIER_URL"] or None, "SHARDSYNC_TIER_URL"
    if url is not None:
        if not isinstance(url, str) or not url.startswith("s3://"):
            raise ConfigError(f"{source} must be an s3://BUCKET/PREFIX URL (got {url!r})")
        try:
            parse_s3_url(url)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    values: dict[str, Any] = {}
    for key in ("claim_lease", "claim_stall", "claim_courtesy"):
        if key in section:
            try:
                values[key] = parse_duration(section[key])
            except ValueError as exc:
                raise ConfigError(f"tier.{key}: {exc}") from None
            if values[key] <= 0 and key != "claim_courtesy":
                raise ConfigError(f"tier.{key} must be positive (got {section[key]!r})")
    if "upload_floor" in section:
        values["upload_floor"] = _coerce("tier.upload_floor", section["upload_floor"], "size")
        if values["upload_floor"] <= 0:
            raise ConfigError("tier.upload_floor must be positive")
    if "part_size" in section:
        values["part_size"] = _coerce("tier.part_size", section["part_size"], "size")
        if values["part_size"] and values["part_size"] < 1 << 20:
            raise ConfigError("tier.part_size must be 0 (no parts) or at least 1MiB")
    return TierConfig(url=url, **values)


def _s3_config(section: Mapping[str, Any]) -> S3Config:
    def text(key: str) -> str | None:
        value = section.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(f"s3.{key} must be a non-empty string (got {value!r})")
        return value

    endpoint = text("endpoint")
    if endpoint is not None:
        check_endpoint("s3.endpoint", endpoint, "http://127.0.0.1:8333")
    addressing = section.get("addressing", "auto")
    if addressing not in ("auto", "path", "virtual"):
        raise ConfigError(f's3.addressing must be "auto", "path" or "virtual" (got {addressing!r})')
    connections = section.get("connections_per_file", S3Config().connections_per_file)
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ConfigError(f"s3.connections_per_file must be at least 1 (got {connections!r})")
    chunk = S3Config().chunk_size
    if "chunk_size" in section:
        chunk = _coerce("s3.chunk_size", section["chunk_size"], "size")
        if chunk < 1 << 20:
            raise ConfigError("s3.chunk_size must be at least 1MiB")
    payer = section.get("requester_pays", False)
    if not isinstance(payer, bool):
        raise ConfigError(f"s3.requester_pays must be true or false (got {payer!r})")
    return S3Config(
        endpoint=endpoint,
        region=text("region"),
        addressing=addressing,
        profile=text("profile"),
        connections_per_file=connections,
        chunk_size=chunk,
        requester_pays=payer,
    )


_DAEMON_KEYS = (
    "socket",
    "socket_mode",
    "group",
    "allowed_uids",
    "allowed_gids",
    "tcp",
    "tcp_allow_remote",
    "max_bandwidth",
    "fallback",
    "history",
)


def _daemon_config(section: Mapping[str, Any], env: Mapping[str, str]) -> DaemonConfig:
    """Validate ``[daemon]``; ``SHARDSYNC_SOCKET``/``_FALLBACK``/``_MAX_BANDWIDTH`` override it."""
    raw = dict(section)
    label = {key: f"daemon.{key}" for key in _DAEMON_KEYS}
    for env_key, key in (
        ("SHARDSYNC_SOCKET", "socket"),
        ("SHARDSYNC_FALLBACK", "fallback"),
        ("SHARDSYNC_MAX_BANDWIDTH", "max_bandwidth"),
    ):
        if env.get(env_key):
            raw[key] = env[env_key]
            label[key] = env_key
    socket = raw.get("socket", "")
    if not isinstance(socket, str):
        raise ConfigError(f"{label['socket']} must be a string path")
    group = group_id("daemon.group", raw["group"]) if "group" in raw else None
    mode = socket_mode(raw.get("socket_mode", 0o660 if group is not None else 0o600))
    uids = id_list("daemon.allowed_uids", raw.get("allowed_uids", []), user_id)
    default_gids = [group] if group is not None else []
    gids = id_list("daemon.allowed_gids", raw.get("allowed_gids", default_gids), group_id)
    allow_remote = raw.get("tcp_allow_remote", False)
    if not isinstance(allow_remote, bool):
        raise ConfigError("daemon.tcp_allow_remote must be true or false")
    tcp = tcp_address(raw.get("tcp", ""), allow_remote=allow_remote)
    fallback = raw.get("fallback", "in-process")
    if fallback not in ("in-process", "error"):
        raise ConfigError(f'{label["fallback"]} must be "in-process" or "error" (got {fallback!r})')
    bandwidth = _coerce(label["max_bandwidth"], raw.get("max_bandwidth", 0), "size")
    history = _coerce("daemon.history", raw.get("history", 100), int)
    if history <= 0:
        raise ConfigError(f"daemon.history must be positive (got {history!r})")
    return DaemonConfig(
        socket=Path(socket).expanduser() if socket else None,
        socket_mode=mode,
        group=group,
        allowed_uids=frozenset(uids),
        allowed_gids=frozenset(gids),
        tcp=tcp,
        tcp_allow_remote=allow_remote,
        max_bandwidth=bandwidth,
        fallback=fallback,
        history=history,
    )


_PRUNE_KEYS = ("max_size", "min_free", "max_age", "pin", "stale_partial_age", "high_water")


def _prune_config(section: Mapping[str, Any]) -> PruneConfig:
    """Validate ``[prune]``; sizes as in ``parse_size``, ages as in ``parse_duration``."""

    def size(key: str) -> int | None:
        return None if key not in section else _coerce(f"prune.{key}", section[key], "size")

    def duration(key: str, default: float | None) -> float | None:
        if key not in section:
            return default
        try:
            return parse_duration(section[key])
        except ValueError as exc:
            raise ConfigError(f"prune.{key}: {exc}") from None

    pin = section.get("pin", [])
    if not isinstance(pin, list) or not all(isinstance(p, str) and p for p in pin):
        raise ConfigError('prune.pin must be a list of repo names or globs, like ["org/*"]')
    config = PruneConfig(
        max_size=size("max_size"),
        min_free=size("min_free"),
        max_age=duration("max_age", None),
        pin=tuple(pin),
        stale_partial_age=duration("stale_partial_age", 86400.0) or 0.0,
        high_water=size("high_water"),
    )
    if (
        config.high_water is not None
        and config.max_size is not None
        and config.high_water < config.max_size
    ):
        raise ConfigError("prune.high_water must be at least prune.max_size")
    return config


def _int_env(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected a whole number, got {raw!r}") from None
