"""Configuration: frozen dataclasses from TOML, environment overrides applied on request.

Nothing is read at import time; ``load_config(path, environ)`` is the one place
that looks at files and variables, so tests pass both explicitly.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from shardsync.errors import ConfigError
from shardsync.fetch import FetchConfig
from shardsync.retry import RetryPolicy

__all__ = ["Config", "default_cache_dir", "load_config", "parse_size"]

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
    number = float(digits)
    if number < 0:
        raise ValueError("size must not be negative")
    return int(number * _UNITS[unit])


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    """``SHARDSYNC_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardsync``, else ``~/.cache/shardsync``."""
    if environ.get("SHARDSYNC_CACHE_DIR"):
        return Path(environ["SHARDSYNC_CACHE_DIR"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "shardsync"


@dataclass(frozen=True, slots=True)
class Config:
    """Everything the engine needs; see ``config.example.toml`` for each key."""

    cache_dir: Path
    endpoint: str | None = None
    max_files: int = 4
    fetch: FetchConfig = field(default_factory=FetchConfig)


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
    "max_verify_attempts": int,
}
_RETRY_KEYS = {
    "max_attempts": int,
    "base_delay": float,
    "max_delay": float,
    "max_retry_after": float,
}


def _coerce(key: str, value: Any, kind: object) -> Any:
    try:
        if kind == "size":
            return parse_size(value)
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("expected an integer")
            return value
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError("expected a number")
            return float(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc} (got {value!r})") from None
    raise ConfigError(f"{key}: unsupported")


def _section(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table")
    return value


def load_config(
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    cache_dir: Path | None = None,
) -> Config:
    """Build the config: file, then ``SHARDSYNC_*``/``HF_ENDPOINT`` variables, then arguments."""
    env = os.environ if environ is None else environ
    data: Mapping[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    known = {"cache", "download", "retry", "hub"}
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
    ):
        for key in _section(data, section):
            if key not in allowed:
                raise ConfigError(f"unknown key {section}.{key}")

    for env_key, key in (
        ("SHARDSYNC_MAX_FILES", "max_files"),
        ("SHARDSYNC_CONNECTIONS_PER_FILE", "connections_per_file"),
        ("SHARDSYNC_CHUNK_SIZE", "chunk_size"),
    ):
        if env_key in env:
            raw = env[env_key]
            download[key] = raw if key == "chunk_size" else _int_env(env_key, raw)

    fetch_kwargs = {
        k: _coerce(f"download.{k}", download[k], t) for k, t in _FETCH_KEYS.items() if k in download
    }
    retry_kwargs = {
        k: _coerce(f"retry.{k}", retry[k], t) for k, t in _RETRY_KEYS.items() if k in retry
    }
    max_files = _coerce("download.max_files", download.get("max_files", 4), int)
    for name, value in (*fetch_kwargs.items(), *retry_kwargs.items(), ("max_files", max_files)):
        if isinstance(value, int | float) and value <= 0 and name != "base_delay":
            raise ConfigError(f"{name} must be positive (got {value!r})")

    fetch = replace(FetchConfig(), **fetch_kwargs, retry=replace(RetryPolicy(), **retry_kwargs))
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
    if endpoint is not None and not isinstance(endpoint, str):
        raise ConfigError("hub.endpoint must be a string")
    return Config(cache_dir=cache_dir, endpoint=endpoint, max_files=max_files, fetch=fetch)


def _int_env(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
