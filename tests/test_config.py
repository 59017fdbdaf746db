from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from shardsync.config import _FETCH_KEYS, load_config, parse_size
from shardsync.errors import ConfigError
from shardsync.fetch import FetchConfig

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


@pytest.mark.parametrize("text", ["", "MiB", "12XB", "-5", "1e", True])
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
        ("[nope]\n", "nope"),
        ("[retry]\nmax_attempts = 0\n", "max_attempts"),
        ("[download\n", "c.toml"),
    ],
)
def test_invalid_config_names_the_key(tmp_path: Path, body: str, needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(body)
    with pytest.raises(ConfigError, match=needle):
        load_config(cfg, {}, cache_dir=tmp_path)


def test_bad_env_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SHARDSYNC_MAX_FILES"):
        load_config(None, {"SHARDSYNC_MAX_FILES": "many"}, cache_dir=tmp_path)
