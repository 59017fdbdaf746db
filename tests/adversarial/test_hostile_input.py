"""Hostile repo ids and revisions are refused before any request; valid odd ones work."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from helpers import fast_config

from shardsync.cache import CacheStore
from shardsync.errors import ConfigError
from shardsync.names import source_kind, validate_revision
from shardsync.origins import parse_source
from shardsync.prefetch import prefetch
from shardsync.testing import FakeHub

BAD_REVISIONS = [
    "..",
    "../main",
    "main/../../etc",
    "refs/pr/../../x",
    "/abs",
    "main\n",
    "ma\x00in",
    "main?x=1",
    "main#frag",
    "ma in",
    "ré\u0301v",
    "a//b",
    "x.lock",
    "",
    "v" * 256,
]


@pytest.mark.parametrize("revision", BAD_REVISIONS, ids=repr)
def test_bad_revisions_are_refused(revision: str) -> None:
    with pytest.raises(ConfigError, match="invalid revision"):
        validate_revision(revision)


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "release/2024-06", "a" * 40])
def test_good_revisions_pass(revision: str) -> None:
    assert validate_revision(revision) == revision


@pytest.mark.parametrize(
    ("source", "folders", "kind"),
    [
        ("https://cdn.example/m/", set(), "url"),
        ("http://mirror:8080/m", {"http://mirror:8080/m"}, "url"),  # a URL, whatever is on disk
        ("s3://bucket/models/", set(), "s3"),
        ("/srv/models/llama", set(), "local"),
        ("./llama", set(), "local"),
        ("~/llama", set(), "local"),
        ("acme/llama", {"acme/llama"}, "local"),  # a folder here wins over the Hub repo id
        ("acme/llama", set(), "hub"),
    ],
)
def test_a_source_names_one_kind_of_origin(source: str, folders: set[str], kind: str) -> None:
    """The rule the CLI decides "daemon or not" by, and ``parse_source`` builds from."""
    assert source_kind(source, is_dir=folders.__contains__) == kind


@pytest.mark.parametrize("source", ["ftp://x/y", "file:///etc", "gs://bucket/m"])
def test_another_scheme_is_refused(source: str) -> None:
    with pytest.raises(ConfigError):
        source_kind(source, is_dir=lambda _: False)


BAD_REPOS = ["../evil", "acme/../x", "acme/x\n", "acme//x", "/etc/passwd", "acme/x?y", "acme/ré"]


@pytest.mark.parametrize("source", BAD_REPOS, ids=repr)
async def test_bad_repo_ids_never_reach_the_network(
    fake_hub: FakeHub, tmp_path: Path, source: str
) -> None:
    with pytest.raises(ConfigError):
        await prefetch(source, fast_config(tmp_path, fake_hub.endpoint))
    assert fake_hub.log == []


@pytest.mark.parametrize("revision", ["../main", "main\n", "refs/pr/../x"], ids=repr)
async def test_bad_revisions_never_reach_the_network(
    fake_hub: FakeHub, tmp_path: Path, revision: str
) -> None:
    with pytest.raises(ConfigError):
        await prefetch("acme/tiny", fast_config(tmp_path, fake_hub.endpoint), revision=revision)
    assert fake_hub.log == []


def test_an_unreadable_token_file_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path))  # a folder
    with pytest.raises(ConfigError, match="cannot read the Hugging Face token file"):
        parse_source("acme/tiny", endpoint="http://127.0.0.1:9", token=None)


async def test_a_symlink_planted_as_a_partial_is_never_written_through(tmp_path: Path) -> None:
    data = b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + os.urandom(2 << 20)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    cache = tmp_path / "cache"
    CacheStore(cache)
    (cache / "partial" / f"{hashlib.sha256(data).hexdigest()}.part").symlink_to(victim)
    async with FakeHub() as hub:
        hub.add_repo("acme/planted", {"model.safetensors": data})
        result = await prefetch("acme/planted", fast_config(cache, hub.endpoint))
    assert victim.read_bytes() == b"precious"
    assert (result.snapshot_path / "model.safetensors").read_bytes() == data
